"""TransformerEngine's attention enums, each member's value being the native option it names.

`AttnMaskType.PADDING_CAUSAL_MASK.value == "padding_causal"` (flashmesh.attention's `mask=`),
`QKVLayout.THD_T2HD.value == "thd_t2hd"` (its `layout=`), `AttnSoftmaxType.LEARNABLE_SOFTMAX.value
== "learnable"` (its `softmax=`). `flashmesh.te.attention` re-exports all of them.
"""

from __future__ import annotations

import enum


class AttnBiasType(enum.Enum):
    """NO_BIAS: softmax(scale * qk); PRE_SCALE_BIAS: softmax(scale * (qk + bias));
    POST_SCALE_BIAS: softmax(scale * qk + bias) (flashmesh's native `bias`)."""

    NO_BIAS = "no_bias"
    PRE_SCALE_BIAS = "pre_scale_bias"
    POST_SCALE_BIAS = "post_scale_bias"


class AttnMaskType(enum.Enum):
    """The value is the native `mask=` string. Padding types need a SequenceDescriptor;
    bottom-right types put the causal diagonal at the last query and key (T != S)."""

    NO_MASK = "none"
    PADDING_MASK = "padding"
    CAUSAL_MASK = "causal"
    PADDING_CAUSAL_MASK = "padding_causal"
    CAUSAL_BOTTOM_RIGHT_MASK = "causal_bottom_right"
    PADDING_CAUSAL_BOTTOM_RIGHT_MASK = "padding_causal_bottom_right"

    def is_causal(self) -> bool:
        return "causal" in self.value

    def is_padding(self) -> bool:
        return self.value.startswith("padding")

    def is_bottom_right(self) -> bool:
        return self.value.endswith("bottom_right")


class AttnSoftmaxType(enum.Enum):
    """VANILLA: exp(s_i) / sum_j exp(s_j); OFF_BY_ONE: denominator + 1; LEARNABLE: denominator
    + exp(alpha[h]) with a learnable per-head alpha (`softmax_offset`). Value: native `softmax=`."""

    VANILLA_SOFTMAX = "vanilla"
    OFF_BY_ONE_SOFTMAX = "off_by_one"
    LEARNABLE_SOFTMAX = "learnable"

    @classmethod
    def from_str(cls, softmax_type: str) -> "AttnSoftmaxType":
        """'vanilla', 'off_by_one' (or 'off-by-one') or 'learnable'."""
        for member in cls:
            if softmax_type.replace("-", "_") == member.value:
                return member
        raise ValueError(f"softmax_type={softmax_type!r} must be one of "
                         f"{[m.value for m in cls]}")


class QKVFormat(enum.Enum):
    """SBHD: [s, b, h, d]; BSHD: [b, s, h, d]; THD: BSHD rows that pack several sequences."""

    SBHD = "sbhd"
    BSHD = "bshd"
    THD = "thd"


class QKVLayout(enum.Enum):
    """How q, k, v arrive in `fused_attn`'s `qkv` tuple; the value is the native `layout=`.

    BS3HD / T3HD: (qkv [b, s, 3, h, d],); BSHD_BS2HD / THD_T2HD: (q [b, s, h, d],
    kv [b, s, 2, h, d]); BSHD_BSHD_BSHD / THD_THD_THD: (q, k, v) each [b, s, h, d].
    T* layouts pack several sequences per row and need a SequenceDescriptor.
    """

    BS3HD = "bs3hd"
    BSHD_BS2HD = "bshd_bs2hd"
    BSHD_BSHD_BSHD = "bshd_bshd_bshd"
    T3HD = "t3hd"
    THD_T2HD = "thd_t2hd"
    THD_THD_THD = "thd_thd_thd"

    def get_qkv_format(self) -> QKVFormat:
        return QKVFormat.THD if self.is_thd() else QKVFormat.BSHD

    def is_qkvpacked(self) -> bool:
        return self in (QKVLayout.BS3HD, QKVLayout.T3HD)

    def is_kvpacked(self) -> bool:
        return self in (QKVLayout.BSHD_BS2HD, QKVLayout.THD_T2HD)

    def is_separate(self) -> bool:
        return self in (QKVLayout.BSHD_BSHD_BSHD, QKVLayout.THD_THD_THD)

    def is_thd(self) -> bool:
        return self in (QKVLayout.T3HD, QKVLayout.THD_T2HD, QKVLayout.THD_THD_THD)

    def to_qkvpacked(self) -> "QKVLayout":
        return QKVLayout.T3HD if self.is_thd() else QKVLayout.BS3HD

    def to_kvpacked(self) -> "QKVLayout":
        return QKVLayout.THD_T2HD if self.is_thd() else QKVLayout.BSHD_BS2HD

    def to_separate(self) -> "QKVLayout":
        return QKVLayout.THD_THD_THD if self.is_thd() else QKVLayout.BSHD_BSHD_BSHD

    @property
    def num_arrays(self) -> int:
        """Length of the `qkv` tuple this layout takes."""
        return 1 if self.is_qkvpacked() else 2 if self.is_kvpacked() else 3


# Native layout of each BSHD layout when batch and sequence are swapped
# (DotProductAttention's transpose_batch_sequence=True).
SEQUENCE_MAJOR_LAYOUTS = {QKVLayout.BS3HD: "sb3hd", QKVLayout.BSHD_BS2HD: "sbhd_sb2hd",
                          QKVLayout.BSHD_BSHD_BSHD: "sbhd"}


class CPStrategy(enum.Enum):
    """Context-parallel strategy (DEFAULT picks one when the context axis is sharded)."""

    DEFAULT = 0
    ALL_GATHER = 1
    RING = 2


class ReorderStrategy(enum.Enum):
    """Token reordering that balances causal work across context-parallel ranks."""

    DualChunkSwap = 0
    Striped = 1


_MASK_ALIASES = {
    "no_mask": AttnMaskType.NO_MASK,
    "padding": AttnMaskType.PADDING_MASK,
    "causal": AttnMaskType.CAUSAL_MASK,
    "padding_causal": AttnMaskType.PADDING_CAUSAL_MASK,
    "causal_padding": AttnMaskType.PADDING_CAUSAL_MASK,
    "causal_bottom_right": AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK,
    "bottom_right_causal": AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK,
    "padding_causal_bottom_right": AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
    "causal_padding_bottom_right": AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
    "bottom_right_causal_padding": AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
    "bottom_right_padding_causal": AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
}


def canonicalize_attn_mask_type(attn_mask_type: str | AttnMaskType) -> AttnMaskType:
    """TransformerEngine's mask strings ('no_mask', 'padding', 'causal', 'padding_causal',
    'causal_bottom_right', ... and their spelled-around aliases) to AttnMaskType."""
    if isinstance(attn_mask_type, AttnMaskType):
        return attn_mask_type
    if isinstance(attn_mask_type, str) and attn_mask_type in _MASK_ALIASES:
        return _MASK_ALIASES[attn_mask_type]
    raise ValueError(f"attn_mask_type={attn_mask_type!r} must be an AttnMaskType or one of "
                     f"{sorted(_MASK_ALIASES)}")


def canonicalize(enum_type: type[enum.Enum], value, name: str):
    """An enum member from itself or its name in any case ('post_scale_bias', 'BS3HD');
    softmax types also from their short strings ('learnable')."""
    if isinstance(value, enum_type):
        return value
    if enum_type is AttnMaskType:
        return canonicalize_attn_mask_type(value)
    if enum_type is AttnSoftmaxType and isinstance(value, str):
        return AttnSoftmaxType.from_str(value)
    if isinstance(value, str) and value.upper() in enum_type.__members__:
        return enum_type[value.upper()]
    raise ValueError(f"{name}={value!r} must be a {enum_type.__name__} or one of "
                     f"{[m.lower() for m in enum_type.__members__]}")
