"""The orchestrator's pure core: task records and their state machine, commit/release planning, DAG execution."""
