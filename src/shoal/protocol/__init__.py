"""Typed wire messages between shoal's processes: one schema per message, shared by both ends.

A leaf package: it imports neither torch nor zmq, so any layer (router and cluster included) may
use it. Headers are msgspec Structs; tensors travel beside them as raw buffers described by a
TensorSpec that is checked before anything is built from the bytes.
"""
