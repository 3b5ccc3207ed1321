"""Safetensors checkpoint files (shards, index, headers), MXFP4 packing, tokenizer and chat format.
The K3 names/layout adapter (`save_pretrained`, `load_pretrained`, `checkpoint_tensors`) is the model's:
`k3.model.state_dict`; `io` never imports `model`."""

from .checkpoint import CheckpointError, read_headers, write_sharded
from .mxfp4 import mxfp4_fake_quantize, mxfp4_pack, mxfp4_unpack

__all__ = ["CheckpointError", "mxfp4_fake_quantize", "mxfp4_pack", "mxfp4_unpack", "read_headers",
           "write_sharded"]
