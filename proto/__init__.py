"""Protobuf wire formats (.proto sources and their generated *_pb2 modules)."""
