"""k3: Kimi K3 in PyTorch — checkpoint-compatible, trainable, every mechanism of the report."""

from .config import K3Config, K3TextConfig, K3VisionConfig
from .model import K3Cache, K3ForConditionalGeneration, K3Output, KimiLinearForCausalLM

__version__ = "0.1.0"
__all__ = ["K3Cache", "K3Config", "K3ForConditionalGeneration", "K3Output", "K3TextConfig", "K3VisionConfig",
           "KimiLinearForCausalLM"]
