"""TransformerEngine's `transformer_engine.jax.activation`: `te.activation.activation`, and the
clamped SwiGLU's parameters (TE's `ActivationParams`, `ClampedSwigluParams`)."""

from flashmesh.nn.activations import ActivationParams, ClampedSwigluParams, activation

__all__ = ["ActivationParams", "ClampedSwigluParams", "activation"]
