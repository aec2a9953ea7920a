"""Generated protobuf/gRPC code of the FlowMaker API (from protos/ by scripts/gen_protos.py; do not edit)."""
