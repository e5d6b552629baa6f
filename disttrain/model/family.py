"""What a model family's config says that training must honour, read in one place.

`Family.of(config)` reads a transformers config (a multimodal wrapper's language sub-config included) once: its
mixture-of-experts routing and router loss, its final-logit softcap, whether its embeddings are tied, whether
transformers has a tensor-parallel plan for it, its heads, and which of its layers attend through a window. The
loss (objectives/token_loss.py), the FLOP count (metrics/flops.py), the loader (model/loading.py) and the
launch checks (parallel/checks.py) ask it instead of each reading config attributes. A new family quirk is a
field here and the one place that honours it. (Transforms that live on the module rather than the config,
Cohere's `logit_scale` or Falcon-H1's `lm_head_multiplier`, are read from the live model by the loss.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.errors import DisttrainError


def text_config(config):
    """The language model's config: multimodal wrappers keep it as a sub-config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def configs_of(config) -> list:
    """A config and its text config, once each (a transform may sit on either)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    return [c for c in {id(c): c for c in (config, text) if c is not None}.values()]


@dataclass(frozen=True)
class Family:
    name: str  # the (text) config's class, as messages name it
    routing: tuple[int, int] | None  # mixture of experts: (experts per block, experts per token)
    router_loss: bool  # the forward returns the router's logits and the load-balancing loss is trained
    router_aux_coef: float  # its weight (0 when router_loss is off)
    softcap: float | None  # final-logit softcapping (Gemma 2/3)
    tied_embeddings: bool
    tp_plan: bool  # transformers ships a tensor-parallel plan for it (base_model_tp_plan)
    heads: int
    kv_heads: int
    windowed_layers: frozenset[str] = field(default_factory=frozenset)  # layer types that do not attend in full
    vision: bool = False  # a vision-language model: an image encoder beside the language model (model/parts.py)
    # images enter through cross-attention layers (Llama 3.2 Vision / Mllama), not as tokens in the sequence
    cross_attention_images: bool = False
    # transformers ships an expert-parallel plan for it that sends the tokens to their experts (base_model_ep_plan)
    ep_plan: bool = False

    @classmethod
    def of(cls, config) -> Family:
        text = text_config(config)
        configs = configs_of(config)
        experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
        top_k = getattr(text, "num_experts_per_tok", None)
        router_loss = any(getattr(c, "output_router_logits", False) for c in configs)
        coef = next((c.router_aux_loss_coef for c in configs if getattr(c, "router_aux_loss_coef", None)), 0.0)
        softcap = next((float(c.final_logit_softcapping) for c in configs
                        if getattr(c, "final_logit_softcapping", None)), None)
        heads = getattr(text, "num_attention_heads", 0) or 0
        layer_types = getattr(text, "layer_types", None)
        windowed = {t for t in (layer_types or []) if t != "full_attention"}
        if layer_types is None and getattr(text, "sliding_window", None):
            windowed = {"sliding_attention"}
        return cls(name=type(text).__name__, routing=(int(experts), int(top_k)) if experts and top_k else None,
                   router_loss=router_loss, router_aux_coef=float(coef) if router_loss else 0.0, softcap=softcap,
                   tied_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
                   tp_plan=bool(getattr(text, "base_model_tp_plan", None)), heads=heads,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads, windowed_layers=frozenset(windowed),
                   vision=getattr(config, "vision_config", None) is not None,
                   cross_attention_images=bool(getattr(text, "cross_attention_layers", None)),
                   ep_plan="ep_dispatch_experts" in (getattr(text, "base_model_ep_plan", None) or {}).values())

    @classmethod
    def of_recipe(cls, spec) -> Family:
        """The recipe's model (its config.json only, before any weight), with the router loss switched on as
        loading will switch it on (model.router_aux_loss_coef). An unreadable config is one line."""
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(spec.name_or_path, revision=spec.revision,
                                                trust_remote_code=spec.trust_remote_code)
        except (OSError, ValueError) as exc:  # no such model, offline, gated, not a transformers config
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DisttrainError(f"model.name_or_path={spec.name_or_path}: its config cannot be read ({first})") \
                from None
        if spec.router_aux_loss_coef is not None:
            text = text_config(config)
            text.output_router_logits, text.router_aux_loss_coef = True, spec.router_aux_loss_coef
        return cls.of(config)

    @property
    def moe(self) -> bool:
        return self.routing is not None
