"""How the ops meet `torch.compile`: each dispatch point runs as it is (its own Triton kernels, host-side checks
and data-dependent loops), and dynamo breaks the graph around it, as fla does for its kernels. Compiled regions
(e.g. a decoder layer) keep the glue between the ops: projections, residual adds, casts."""
from __future__ import annotations

import torch


def eager_op(fn):
    """Mark an op's public entry point as opaque to torch.compile."""
    return torch.compiler.disable(fn)
