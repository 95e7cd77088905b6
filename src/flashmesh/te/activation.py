"""TransformerEngine's `transformer_engine.jax.activation`: `te.activation.activation`."""

from flashmesh.nn.mlp import activation

__all__ = ["activation"]
