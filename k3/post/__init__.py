"""Post-training: the K3 chat format (XTML) and, later, SFT / RL / MOPD / draft training."""

from .xtml import XTMLError, XTMLStreamParser, build_segments, parse, render

__all__ = ["XTMLError", "XTMLStreamParser", "build_segments", "parse", "render"]
