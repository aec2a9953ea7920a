"""gRPC plumbing shared by the five services: server bootstrap, the error map, channels."""
