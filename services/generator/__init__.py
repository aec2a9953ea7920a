"""The generator service: GenerateWorkflows over gRPC, backed by flowmaker.generator."""
