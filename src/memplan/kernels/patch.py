"""`apply(model)`: train a transformers model with memplan's kernels, in place and reversibly (`revert`).

- loss: the fused linear + cross-entropy (kernels/cross_entropy.py). For the causal LMs of the families
  with a `Family.fused_loss_causal_base` (estimator/families.py) the patched forward runs the model's own
  base model, then computes the loss from the last hidden states and the LM head's weight exactly as
  transformers' ForCausalLMLoss does (labels shifted by one, ignore_index -100, the mean over the targets or
  over `num_items_in_batch`, Gemma 2's final logit soft-capping). For the masked LMs with a
  `Family.fused_loss_mlm_base` (BERT's) it runs the head's transform and the loss of the decoder, its bias
  included, as BertForMaskedLM's CrossEntropyLoss does. It returns no logits when labels are given; without
  labels the original forward runs.
- mlp: the tiled MLP (kernels/mlp.py) on every layer's MLP, for the families with `Family.tiled_mlp`: the
  `mlp` module (OLMo 2's post_feedforward_layernorm is outside it), or the token-wise feed_forward_chunk of
  `Family.tiled_ffn_layer` (BertLayer: intermediate, output dense, dropout, LayerNorm).
- attention: memplan's tiled attention (kernels/attention.py) as the model's attn_implementation
  ("memplan"), for the families with `Family.memplan_attention` (attention through transformers'
  AttentionInterface, without attention dropout or logit soft-capping).

Each of loss / mlp / attention is applied where the model supports it; `apply` refuses a model none of
them supports, and a request whose only effect would be unsupported, with a message saying what is.
"""

from __future__ import annotations

import types

import torch

from memplan.estimator.families import GATED_ACT_KERNEL, family, model_types

from .cross_entropy import linear_cross_entropy

SUPPORTED = model_types(lambda f: f.kernels)
_ORIGINAL = "_memplan_original_forward"
_APPLIED = "_memplan_kernels"  # what apply did: {"loss": bool, "mlp": [modules], "attention": previous impl}
_FFN = "feed_forward_chunk"  # BertLayer's token-wise feed-forward


def apply(model: torch.nn.Module, *, loss: bool = True, mlp: bool = True, attention: bool = False,
          mlp_chunk: int | None = None) -> torch.nn.Module:
    """Patch `model` in place (and return it): the fused loss, the tiled MLP and the tiled attention,
    each where the model supports it (module docstring). memplan's plans say which to turn on.

    mlp_chunk: tokens per chunk of the tiled MLP (default: the hidden size, kernels/mlp.py)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fam = family(model_type)
    if not fam.kernels:
        raise ValueError(f"memplan.kernels.apply supports {', '.join(SUPPORTED)}; "
                         f"not {type(model).__name__} ({model_type})")
    if hasattr(model, _APPLIED):
        revert(model)
    done = {"loss": False, "mlp": [], "attention": None}
    base_name, mlm_base = fam.fused_loss_causal_base, fam.fused_loss_mlm_base
    if loss and base_name and hasattr(model, base_name) and hasattr(model, "lm_head"):
        setattr(model, _ORIGINAL, model.forward)
        model.forward = types.MethodType(_forward_with(base_name), model)
        done["loss"] = True
    elif loss and mlm_base and hasattr(model, mlm_base) and hasattr(getattr(model, "cls", None), "predictions"):
        setattr(model, _ORIGINAL, model.forward)
        model.forward = types.MethodType(_masked_lm_forward_with(mlm_base), model)
        done["loss"] = True
    elif loss and not (mlp or attention):
        raise ValueError(f"memplan.kernels.apply(loss=True): the fused loss is for the causal LMs of "
                         f"{', '.join(model_types(lambda f: f.fused_loss_causal_base))} and the masked LMs of "
                         f"{', '.join(model_types(lambda f: f.fused_loss_mlm_base))}; not {type(model).__name__}")
    if mlp and fam.tiled_mlp:
        done["mlp"] = _tile_mlps(model, fam.tiled_ffn_layer, mlp_chunk)
    if attention:
        done["attention"] = _use_tiled_attention(model)
    setattr(model, _APPLIED, done)
    return model


def applied(model: torch.nn.Module) -> dict:
    """What `apply` did to `model`: {"loss": bool, "mlp": number of MLPs tiled, "attention": bool}."""
    done = getattr(model, _APPLIED, None) or {"loss": False, "mlp": [], "attention": None}
    return {"loss": done["loss"], "mlp": len(done["mlp"]), "attention": done["attention"] is not None}


def revert(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `apply`."""
    from .mlp import unpatch_mlp

    done = getattr(model, _APPLIED, None)
    if done is None:
        return model
    if hasattr(model, _ORIGINAL):
        del model.forward  # the instance attribute: the class's forward shows again
        delattr(model, _ORIGINAL)
    for m in done["mlp"]:
        if _FFN in vars(m):
            delattr(m, _FFN)
        else:
            unpatch_mlp(m)
    if done["attention"] is not None:
        model.set_attn_implementation(done["attention"])
    delattr(model, _APPLIED)
    return model


def _tile_mlps(model: torch.nn.Module, ffn_layer: str | None, chunk: int | None) -> list[torch.nn.Module]:
    """Tile every `*MLP` module, or the feed_forward_chunk of every `ffn_layer` (families.Family.tiled_ffn_layer)."""
    from .mlp import patch_mlp

    out = []
    for m in model.modules():
        if ffn_layer:
            if type(m).__name__ == ffn_layer:
                # the feed-forward (intermediate -> output dense -> dropout -> LayerNorm with the residual)
                # is token-wise; BertLayer.forward calls it through apply_chunking_to_forward
                setattr(m, _FFN, _tiled_feed_forward(m, chunk))
                out.append(m)
        elif type(m).__name__.endswith("MLP"):  # LlamaMLP, GPT2MLP, ... (these families have dense MLPs only)
            act = _gated_act_name(m)
            if act is not None:  # a gated MLP: act(gate) * up through gated_act (Triton on CUDA)
                m.forward = _gated_forward(m, act)
            patch_mlp(m, chunk)  # keeps m.forward (the gated one) as the tiled MLP's fn; unpatch drops both
            out.append(m)
    return out


def _gated_act_name(mlp: torch.nn.Module) -> str | None:
    """gated_act's name for this MLP's activation, if it is a gate / up / down MLP gated_act can run: the
    activation module is the class transformers' ACT2CLS builds for a name in families.GATED_ACT_KERNEL;
    others (NewGELU, exact GELU, ...) keep the module's own forward."""
    from transformers.activations import ACT2CLS

    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return None
    for hidden_act, name in GATED_ACT_KERNEL.items():
        cls = ACT2CLS[hidden_act]
        if type(mlp.act_fn) is (cls[0] if isinstance(cls, tuple) else cls):  # (class, kwargs) entries
            return name
    return None


def _gated_forward(mlp: torch.nn.Module, act: str):
    from .mlp import gated_act

    def forward(x):
        return mlp.down_proj(gated_act(mlp.gate_proj(x), mlp.up_proj(x), act))
    return forward


def _tiled_feed_forward(layer: torch.nn.Module, chunk: int | None):
    from .mlp import tiled_mlp

    original = layer.feed_forward_chunk
    params = list(layer.intermediate.parameters()) + list(layer.output.parameters())

    def feed_forward_chunk(attention_output):  # one argument: apply_chunking_to_forward counts them
        return tiled_mlp(original, attention_output, params, chunk)
    return feed_forward_chunk


def _use_tiled_attention(model: torch.nn.Module) -> str:
    """Switch the model to the "memplan" attn_implementation; return the one it had."""
    from .attention import DROPOUT_FIELDS, NAME, register

    config = model.config
    for field in DROPOUT_FIELDS:
        if getattr(config, field, 0) and model.training:
            raise ValueError(f"memplan.kernels.apply(attention=True): the tiled attention has no attention dropout; "
                             f"set config.{field} = 0 (it is {getattr(config, field)})")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError("memplan.kernels.apply(attention=True): the tiled attention has no logit soft-capping "
                         f"(config.attn_logit_softcapping = {config.attn_logit_softcapping})")
    fam = family(config.model_type)
    if not fam.memplan_attention:
        # e.g. Falcon calls SDPA or its own eager code, not the AttentionInterface "memplan" registers; MLA
        # (deepseek_v3): queries and keys are qk_nope + qk_rope wide, values v_head_dim, and the tiled kernel takes
        # one head_dim for q, k and v (kernels/attention.py)
        why = " (its values are narrower than its queries and keys)" if getattr(config, "kv_lora_rank", None) else ""
        raise ValueError(f"memplan.kernels.apply(attention=True): the tiled attention is for "
                         f"{', '.join(model_types(lambda f: f.memplan_attention))}; not {type(model).__name__} "
                         f"({config.model_type}){why}")
    previous = config._attn_implementation
    register()
    model.set_attn_implementation(NAME)
    return previous


def _forward_with(base_name: str):
    def forward(self, input_ids=None, labels=None, num_items_in_batch=None, logits_to_keep=0, **kwargs):
        if labels is None:
            return getattr(self, _ORIGINAL)(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        outputs = getattr(self, base_name)(input_ids=input_ids, **kwargs)
        hidden = outputs.last_hidden_state
        # tokens < n predict n (ForCausalLMLoss pads the labels with -100 and shifts them)
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = linear_cross_entropy(hidden, self.lm_head.weight, shift.to(hidden.device),
                                    softcap=getattr(self.config, "final_logit_softcapping", None),
                                    num_items_in_batch=num_items_in_batch)
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(outputs, "past_key_values", None),
                                      hidden_states=getattr(outputs, "hidden_states", None),
                                      attentions=getattr(outputs, "attentions", None))
    return forward


def _masked_lm_forward_with(base_name: str):
    """BertForMaskedLM's forward with the fused loss: the encoder, the head's transform (dense, activation,
    LayerNorm), then the loss of the decoder (weight + bias) against the labels as they are (no shift),
    the mean over the labels that are not -100, as its CrossEntropyLoss takes it."""
    def forward(self, input_ids=None, labels=None, **kwargs):
        if labels is None:
            return getattr(self, _ORIGINAL)(input_ids=input_ids, **kwargs)
        from transformers.modeling_outputs import MaskedLMOutput

        outputs = getattr(self, base_name)(input_ids, return_dict=True, **kwargs)
        head = self.cls.predictions
        hidden = head.transform(outputs[0])
        loss = linear_cross_entropy(hidden, head.decoder.weight, labels.to(hidden.device), bias=head.decoder.bias)
        return MaskedLMOutput(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                              attentions=outputs.attentions)
    return forward
