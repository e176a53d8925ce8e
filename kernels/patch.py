"""`apply(model)`: train a transformers causal LM with memplan's fused linear + cross-entropy, so the
b*s x V logits (and their fp32 up-cast and gradient) are never materialised. Reversible (`revert`).

The patched forward runs the model's own base model, then computes the loss from the last hidden
states and the LM head's weight exactly as transformers' ForCausalLMLoss does (labels shifted by one,
ignore_index -100, the mean over the targets or over `num_items_in_batch`, Gemma 2's final logit
soft-capping). It returns no logits when labels are given; without labels the original forward runs.
"""

from __future__ import annotations

import types

import torch

from memplan.rules import FUSED_LOSS_FAMILIES as SUPPORTED  # model_type -> the base model's attribute

from .cross_entropy import linear_cross_entropy

_ORIGINAL = "_memplan_original_forward"


def apply(model: torch.nn.Module) -> torch.nn.Module:
    """Patch `model` in place (and return it)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    base_name = SUPPORTED.get(model_type)
    if base_name is None or not hasattr(model, base_name) or not hasattr(model, "lm_head"):
        raise ValueError(f"memplan.kernels.apply supports the causal LMs of {', '.join(sorted(SUPPORTED))}; "
                         f"not {type(model).__name__} ({model_type})")
    if hasattr(model, _ORIGINAL):
        return model
    setattr(model, _ORIGINAL, model.forward)
    model.forward = types.MethodType(_forward_with(base_name), model)
    return model


def revert(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `apply`."""
    if hasattr(model, _ORIGINAL):
        del model.forward  # the instance attribute: the class's forward shows again
        delattr(model, _ORIGINAL)
    return model


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
