"""Stock's MoE router aux loss, repacked per sample (torch layer).

TRL 1.16 trains every mixture-of-experts model whose config has ``output_router_logits`` with its load-balancing aux
loss (``router_aux_loss_coef`` from the model's config unless set): for each fixed slice ``m`` (one micro-batch)
it adds ``coef x aux(m) / GA``, where the aux loss its fused LM head computes, transformers' (Mixtral's)
``load_balancing_loss_func`` with the config's ``num_experts`` and ``num_experts_per_tok``, is

    aux(m) = E x sum_e C_e(m) S_e(m) / (L n_m)^2

over the ``L`` router layers and the ``n_m`` unmasked (prompt + completion) tokens of ``m``: ``C_e`` the top-k
assignments of expert ``e`` (no gradient), ``S_e`` the sum of its router probability (the gradient). Both are sums
over tokens, and a token's routing depends on its own sample only, so ``C_e(m)`` and ``n_m`` are sums over ``m``'s
samples of per-sample counts, and stock's term is ``sum over samples i of sum_e W_e(i) s_e(i)`` with the fixed weights
``W_e(i) = coef E C_e(m(i)) / (GA (L n_m(i))^2)`` and ``s_e(i)`` the probability sums of sample ``i``. So:

1. one no-grad router pass over the optimizer step's samples (before any backward: the same parameters as the
   training passes) gives every sample's expert counts and tokens; one all-reduce sums them per stock slice of
   every process (:meth:`RouterAuxLoss.add_counts`, :meth:`RouterAuxLoss.agree`);
2. each training pass adds, for the samples it holds, ``sum_e W_e(i) s_e(i)`` from its own router logits
   (:meth:`RouterAuxLoss.term`; a shared prompt's tokens count once per sample that shares it, as stock computes
   the prompt once per sample);
3. ``aux_loss`` is logged per stock slice, averaged over processes, as stock logs it (:meth:`RouterAuxLoss.publish`).

The loss, its gradient and the logged value are stock's, whatever the passes.
"""

from __future__ import annotations

import contextlib

import torch

from hf_dynbsz.parallel.collectives import reduce_sum
from hf_dynbsz.planning.model_support import base_model

__all__ = ["RouterAuxLoss", "captured_router_logits", "router_statistics"]


@contextlib.contextmanager
def captured_router_logits(model):
    """The router logits of the forwards run inside the context, in a list (one tuple of per-layer logits per
    forward). TRL's fused LM head returns the aux loss of the whole pass but not the logits, so they are taken from
    the output of the model's backbone (what the fused head reads them from) by a forward hook. ``model``: the
    unwrapped model (PEFT's wrapper or the causal LM)."""
    causal_lm = base_model(model)
    captured: list = []
    handle = causal_lm.base_model.register_forward_hook(
        lambda module, args, output: captured.append(output.router_logits)
    )
    try:
        yield captured
    finally:
        handle.remove()


def router_statistics(
    router_logits,
    token_index: torch.Tensor,
    row_index: torch.Tensor,
    rows: int,
    top_k: int,
    num_experts: int,
    pair_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (sample) of a pass: ``(counts, probabilities)``, each ``(rows, num_experts)`` summed over the router
    layers and the row's tokens.

    ``router_logits``: the model's per-layer ``(tokens of the pass, experts)`` logits; ``(token_index, row_index)``
    pairs say which flat token position counts for which row (:attr:`hf_dynbsz.execution.packing.MicroBatch.token_rows`:
    a shared prompt's tokens for every sample sharing it, padding for none). ``pair_weights`` (one per pair, None: 1
    each): how much each pair counts, an asynchronous step's share of a position its samples share
    (:class:`RouterAuxLoss`'s ``token_weights``). ``counts`` are the top-k assignments (float64, no gradient);
    ``probabilities`` keep the gradient.
    """
    counts = torch.zeros(rows, num_experts, dtype=torch.float64, device=token_index.device)
    probabilities = None
    for layer in router_logits:
        weights = torch.softmax(layer.float(), dim=-1)[token_index]  # (pairs, experts)
        chosen = torch.topk(weights.detach(), top_k, dim=-1).indices
        one_hot = torch.zeros_like(weights, dtype=torch.float64).scatter_(1, chosen, 1.0)
        if pair_weights is not None:
            one_hot = one_hot * pair_weights.double().unsqueeze(1)
            weights = weights * pair_weights.to(weights.dtype).unsqueeze(1)
        counts.index_add_(0, row_index, one_hot)
        summed = torch.zeros(rows, num_experts, dtype=weights.dtype, device=weights.device).index_add(
            0, row_index, weights
        )
        probabilities = summed if probabilities is None else probabilities + summed
    return counts, probabilities


class RouterAuxLoss:
    """The router aux loss of one optimizer step: stock's slices' counts, each sample's weights, the logged value.

    ``num_slices``: stock slices of the step over all processes (slice ``s`` of process ``p`` is ``p x slices +
    s``, as :class:`hf_dynbsz.execution.batch.StepBatch` numbers them); ``coef``: TRL's ``router_aux_loss_coef``;
    ``gradient_accumulation_steps``: stock's divisor of the aux loss. ``token_weights`` (None: every position counts
    once per sample holding it, as GRPOTrainer's padded slices count a shared prompt): per sample of the step's table,
    each position's weight; ``AsyncGRPOTrainer``'s packed rows count a position its samples share once, so there each
    sample's share of it (:func:`hf_dynbsz.execution.async_loss.position_shares`). The weighted counts and
    probability sums are stock's exactly: a shared position routes the same in every sample holding it.
    """

    def __init__(
        self,
        coef: float,
        num_experts: int,
        top_k: int,
        num_slices: int,
        gradient_accumulation_steps: int,
        device,
        token_weights: list[torch.Tensor] | None = None,
    ) -> None:
        self.coef, self.num_experts, self.top_k = coef, num_experts, top_k
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.token_weights = token_weights
        # per slice: expert counts (E), tokens (1); and the detached probability sums of the training passes (E)
        self.counts = torch.zeros(num_slices, num_experts + 1, dtype=torch.float64, device=device)
        self.probabilities = torch.zeros(num_slices, num_experts, dtype=torch.float64, device=device)

    @property
    def width(self) -> int:
        """Values per sample of the router pass: expert counts, then tokens."""
        return self.num_experts + 1

    def pair_weights(self, samples: list[int], device) -> torch.Tensor | None:
        """The weight of each pair of a pass of the table's ``samples`` (their positions in order, sample by sample,
        as the collator's ``token_rows`` lists them), or None when every pair counts once."""
        if self.token_weights is None:
            return None
        return torch.cat([self.token_weights[sample] for sample in samples]).to(device)

    def pass_statistics(
        self, router_logits, token_rows: tuple[torch.Tensor, torch.Tensor], rows: int, samples: list[int] | None = None
    ) -> torch.Tensor:
        """``(rows, width)`` statistics of one pass of the router pass: each sample's expert counts, then tokens.
        ``samples``: the pass's samples (table indices), for ``token_weights``."""
        token_index, row_index = token_rows
        pairs = self.pair_weights(samples, token_index.device) if samples is not None else None
        counts, _ = router_statistics(router_logits, token_index, row_index, rows, self.top_k, self.num_experts, pairs)
        ones = counts.new_ones(row_index.numel()) if pairs is None else pairs.double()
        tokens = counts.new_zeros(rows).index_add_(0, row_index, ones).unsqueeze(1)
        return torch.cat([counts, tokens], dim=1)

    def add_counts(self, slice_ids: torch.Tensor, statistics: torch.Tensor) -> None:
        """This process's samples' ``(samples, width)`` statistics of the router pass, into their stock slices."""
        self.counts.index_add_(0, slice_ids.to(self.counts.device), statistics.to(self.counts))

    def agree(self, accelerator) -> None:
        """Sum the slices' counts over processes (every process then holds every slice's)."""
        self.counts = reduce_sum(self.counts)

    def _routed(self, counts: torch.Tensor) -> torch.Tensor:
        """``L x n_m`` of slices with these counts: every token of every router layer picks ``top_k`` experts."""
        return (counts[..., :-1].sum(dim=-1) / self.top_k).clamp(min=1.0)

    def weights(self, slice_ids: torch.Tensor) -> torch.Tensor:
        """``(samples, E)`` weights ``coef E C_e(m) / (GA (L n_m)^2)`` of samples of the stock slices ``slice_ids``."""
        counts = self.counts[slice_ids.to(self.counts.device)]
        scale = self.coef * self.num_experts / (self.gradient_accumulation_steps * self._routed(counts) ** 2)
        return counts[:, :-1] * scale.unsqueeze(1)

    def term(
        self,
        router_logits,
        token_rows: tuple[torch.Tensor, torch.Tensor],
        slice_ids: torch.Tensor,
        samples: list[int] | None = None,
    ) -> torch.Tensor:
        """The aux loss of one training pass's samples (scalar, with gradient), from its router logits. ``samples``:
        the pass's samples (table indices), for ``token_weights``."""
        token_index, row_index = token_rows
        pairs = self.pair_weights(samples, token_index.device) if samples is not None else None
        _, probabilities = router_statistics(
            router_logits, token_index, row_index, len(slice_ids), self.top_k, self.num_experts, pairs
        )
        self.probabilities.index_add_(0, slice_ids.to(self.probabilities.device), probabilities.detach().double())
        weights = self.weights(slice_ids).to(probabilities.dtype)
        return (weights * probabilities).sum()

    def publish(self, metrics: dict[str, list], accelerator) -> None:
        """Stock's ``aux_loss`` figure: per stock slice, ``aux(m)`` averaged over processes, one entry per slice."""
        probabilities = reduce_sum(self.probabilities)
        aux = self.num_experts * (self.counts[:, :-1] * probabilities).sum(dim=1) / self._routed(self.counts) ** 2
        for value in aux.float().view(accelerator.num_processes, -1).mean(0):
            metrics["aux_loss"].append(value.item())
