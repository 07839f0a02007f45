"""The definition's Transformer as a module: ``Transformer = Block_N ∘ ... ∘ Block_1``.

Each block owns exactly the definition's matrices and nothing else (no LayerNorm, no positional
encoding, no biases in attention), and computes ``Block = FF ∘ Attention`` with
:func:`aftlab.functional.seed_attention` and :func:`aftlab.functional.seed_feedforward`.
See docs/definition.md for the formulas and the symbol mapping (``X = x[b].T``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._checks import check_positive_int, check_tensor
from ..functional.seed import seed_attention, seed_feedforward

__all__ = ["SeedTransformer", "SeedBlock"]


def _sizes(where: str, d: int, heads: int, head_dim: int, hidden: int) -> None:
    check_positive_int(where, "d", d)
    check_positive_int(where, "heads", heads)
    check_positive_int(where, "head_dim", head_dim)
    check_positive_int(where, "hidden", hidden)


class SeedBlock(nn.Module):
    r"""One block of the definition: ``Block(X) = FF(Attention(X))``.

    Parameters (the definition's symbols; ``H`` heads of width ``m``, hidden width ``r``):

    ============  ============  ==========================
    attribute     shape         symbol
    ============  ============  ==========================
    ``w_q``       ``(H, m, d)``  ``W_h^Q = w_q[h]``
    ``w_k``       ``(H, m, d)``  ``W_h^K = w_k[h]``
    ``w_v``       ``(H, m, d)``  ``W_h^V = w_v[h]``
    ``w_o``       ``(H, d, m)``  ``W_h^O = w_o[h]``
    ``w1``        ``(r, d)``     ``W_1``
    ``b1``        ``(r,)``       ``b_1``
    ``w2``        ``(d, r)``     ``W_2``
    ``b2``        ``(d,)``       ``b_2``
    ============  ============  ==========================

    That is ``4Hmd + 2rd + r + d`` numbers, independent of the sequence length ``n``.

    Args:
        d: embedding dimension ``d``.
        heads: number of heads ``H``.
        head_dim: per-head dimension ``m``.
        hidden: feed-forward hidden dimension ``r``.
        depth: number of blocks ``N`` of the whole stack; used only to scale the initialisation
            of the residual branches (see :meth:`reset_parameters`).
        device: device of the parameters.
        dtype: dtype of the parameters.
    """

    def __init__(
        self,
        d: int,
        heads: int,
        head_dim: int,
        hidden: int,
        *,
        depth: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _sizes("SeedBlock", d, heads, head_dim, hidden)
        self.depth = check_positive_int("SeedBlock", "depth", depth)
        self.d, self.heads, self.head_dim, self.hidden = d, heads, head_dim, hidden
        f = {"device": device, "dtype": dtype}
        H, m, r = heads, head_dim, hidden
        self.w_q = nn.Parameter(torch.empty(H, m, d, **f))
        self.w_k = nn.Parameter(torch.empty(H, m, d, **f))
        self.w_v = nn.Parameter(torch.empty(H, m, d, **f))
        self.w_o = nn.Parameter(torch.empty(H, d, m, **f))
        self.w1 = nn.Parameter(torch.empty(r, d, **f))
        self.b1 = nn.Parameter(torch.empty(r, **f))
        self.w2 = nn.Parameter(torch.empty(d, r, **f))
        self.b2 = nn.Parameter(torch.empty(d, **f))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        r"""Scaled-normal initialisation that keeps logits ``O(1)`` and deep stacks bounded.

        For an input with unit-variance coordinates:

        * ``W^Q, W^K ~ N(0, 1/(d·sqrt(m)))``: each entry of ``q = W^Q x`` and ``k = W^K x`` has
          variance ``1/sqrt(m)``, so a logit ``k·q`` (a sum of ``m`` products) has variance about
          1. This plays the role of the practical model's ``1/sqrt(m)`` scaling, which the
          definition does not have, without changing the function's form.
        * ``W^V ~ N(0, 1/d)``, ``W_1 ~ N(0, 2/d)`` (He, for the ReLU): unit-scale activations.
        * ``W^O ~ N(0, 1/(H·m·2N))``, ``W_2 ~ N(0, 1/(r·2N))``: each of the ``2N`` residual
          branches adds variance about ``1/(2N)`` of its input, so the residual stream grows by at
          most a factor of about ``(1 + 1/(2N))^{2N} <= e`` in variance over the whole stack,
          for any depth ``N`` (the GPT-2 residual scaling).
        * ``b_1 = 0``, ``b_2 = 0``.
        """
        d, m, H, r, N = self.d, self.head_dim, self.heads, self.hidden, self.depth
        std_qk = (d * math.sqrt(m)) ** -0.5
        nn.init.normal_(self.w_q, std=std_qk)
        nn.init.normal_(self.w_k, std=std_qk)
        nn.init.normal_(self.w_v, std=d**-0.5)
        nn.init.normal_(self.w_o, std=(H * m * 2 * N) ** -0.5)
        nn.init.normal_(self.w1, std=(2.0 / d) ** 0.5)
        nn.init.zeros_(self.b1)
        nn.init.normal_(self.w2, std=(r * 2 * N) ** -0.5)
        nn.init.zeros_(self.b2)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """``Attention(X)`` of this block; ``x: (..., n, d)`` -> ``(..., n, d)``."""
        return seed_attention(x, self.w_q, self.w_k, self.w_v, self.w_o)

    def feedforward(self, x: torch.Tensor) -> torch.Tensor:
        """``FF(X)`` of this block; ``x: (..., n, d)`` -> ``(..., n, d)``."""
        return seed_feedforward(x, self.w1, self.b1, self.w2, self.b2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``Block(X) = FF(Attention(X))``; ``x: (..., n, d)`` -> ``(..., n, d)``."""
        return self.feedforward(self.attention(x))

    def extra_repr(self) -> str:
        return f"d={self.d}, heads={self.heads}, head_dim={self.head_dim}, hidden={self.hidden}"


class SeedTransformer(nn.Module):
    r"""The Transformer of the definition: ``Transformer = Block_N ∘ ... ∘ Block_1``.

    With ``X ∈ R^{d×n}`` (one token per column; batch-first ``X = x[b].T``)::

        Attention(X) = X + Σ_h W_h^O (W_h^V X) Softmax[(W_h^K X)^T (W_h^Q X)]   (column softmax)
        FF(X)        = X + W_2 ReLU(W_1 X + b_1 1^T) + b_2 1^T
        Block        = FF ∘ Attention

    Its parameters are exactly the definition's matrices, ``N(4Hmd + 2rd + r + d)`` numbers in
    all, for every sequence length ``n``; and it is permutation-equivariant,
    ``Transformer(XP) = Transformer(X)P`` (there is no positional information). Parameters are
    ``blocks[i].w_q`` etc.; see :class:`SeedBlock` for the table and the initialisation.

    Args:
        d: embedding dimension ``d``.
        heads: number of heads ``H``.
        head_dim: per-head dimension ``m``.
        hidden: feed-forward hidden dimension ``r``.
        depth: number of blocks ``N``.
        device: device of the parameters.
        dtype: dtype of the parameters.

    Example:
        >>> import torch
        >>> from aftlab.models import SeedTransformer
        >>> model = SeedTransformer(d=16, heads=2, head_dim=8, hidden=32, depth=3)
        >>> model(torch.randn(4, 10, 16)).shape
        torch.Size([4, 10, 16])
        >>> model.num_parameters() == SeedTransformer.expected_num_parameters(16, 2, 8, 32, 3)
        True
    """

    def __init__(
        self,
        d: int,
        heads: int,
        head_dim: int,
        hidden: int,
        depth: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _sizes("SeedTransformer", d, heads, head_dim, hidden)
        check_positive_int("SeedTransformer", "depth", depth)
        self.d, self.heads, self.head_dim, self.hidden = d, heads, head_dim, hidden
        self.depth = depth
        self.blocks = nn.ModuleList(
            SeedBlock(d, heads, head_dim, hidden, depth=depth, device=device, dtype=dtype)
            for _ in range(depth)
        )

    def reset_parameters(self) -> None:
        """Re-initialise every block (see :meth:`SeedBlock.reset_parameters`)."""
        for block in self.blocks:
            block.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply ``Block_N ∘ ... ∘ Block_1``.

        Args:
            x: ``(..., n, d)``, floating, same dtype and device as the parameters.

        Returns:
            ``Transformer(X)`` batch-first, shape ``(..., n, d)``.

        Raises:
            TypeError: ``x`` is not a floating tensor or its dtype differs from the parameters'.
            ValueError: ``x`` has fewer than 2 dimensions or its last dimension is not ``d``.
        """
        where = "SeedTransformer"
        check_tensor(where, "x", x, floating=True)
        if x.dim() < 2 or x.shape[-1] != self.d:
            raise ValueError(
                f"{where}: 'x' must have shape (..., n, d) with d = {self.d}, "
                f"got {tuple(x.shape)}"
            )
        p = self.blocks[0].w_q
        if x.dtype != p.dtype:
            raise TypeError(f"{where}: 'x' has dtype {x.dtype} but the parameters have {p.dtype}")
        for block in self.blocks:
            x = block(x)
        return x

    def num_parameters(self) -> int:
        """Number of scalar parameters, ``sum(p.numel() for p in self.parameters())``."""
        return sum(p.numel() for p in self.parameters())

    @staticmethod
    def expected_num_parameters(d: int, heads: int, head_dim: int, hidden: int, depth: int) -> int:
        """The definition's count ``N(4Hmd + 2rd + r + d)``, with ``H, m, r, N`` as named here."""
        where = "SeedTransformer.expected_num_parameters"
        _sizes(where, d, heads, head_dim, hidden)
        check_positive_int(where, "depth", depth)
        H, m, r, N = heads, head_dim, hidden, depth
        return N * (4 * H * m * d + 2 * r * d + r + d)

    def extra_repr(self) -> str:
        return (
            f"d={self.d}, heads={self.heads}, head_dim={self.head_dim}, hidden={self.hidden}, "
            f"depth={self.depth}"
        )
