"""The deployer: a per-node agent that owns the node's GPUs and runs model instances on them."""
