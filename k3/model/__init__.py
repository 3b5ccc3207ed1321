from .cache import K3Cache
from .k3 import K3ForConditionalGeneration, K3Output, KimiLinearForCausalLM

__all__ = ["K3Cache", "K3ForConditionalGeneration", "K3Output", "KimiLinearForCausalLM"]
