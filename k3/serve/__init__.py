"""Serving engine: unified paged pool, KDA-aware prefix cache, continuous batching (K3_SPEC §9).

    from k3.serve import Engine, EngineConfig, SamplingParams
    engine = Engine(model.eval(), EngineConfig(block_size=6144, hash_block_size=512))
    rid = engine.submit(prompt_ids, SamplingParams(max_tokens=64, temperature=0))
    while engine.has_unfinished():
        for out in engine.step(): ...
"""

from .engine import Engine, EngineConfig
from .request import RequestOutput, SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
