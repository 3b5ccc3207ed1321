"""Checkpoint I/O (HF safetensors layout of the release) and MXFP4 packing."""

from .checkpoint import CheckpointError, checkpoint_tensors, load_pretrained, save_pretrained
from .mxfp4 import mxfp4_fake_quantize, mxfp4_pack, mxfp4_unpack

__all__ = ["CheckpointError", "checkpoint_tensors", "load_pretrained", "mxfp4_fake_quantize", "mxfp4_pack",
           "mxfp4_unpack", "save_pretrained"]
