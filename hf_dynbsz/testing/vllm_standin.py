"""A stand-in for vLLM behind TRL's own ``VLLMGeneration``: TRL's vLLM path (``use_vllm=True``, server and colocate
mode) run on a machine without vLLM or a GPU.

TRL 1.16's GRPOTrainer, RLOOTrainer and DistillationTrainer build ``VLLMGeneration(model=..., accelerator=...,
mode=..., ...)`` (the name each trainer module imports) and call three things on it: ``sync_weights()`` when the
optimizer step changed, ``generate(prompts, images, num_generations, profiler)`` returning ``(prompt_ids,
completion_ids, logprobs, logprob_token_ids)``, and in server mode with importance-sampling correction, on the main
process, ``vllm_client.get_server_info()["model_config"]["logprobs_mode"]``. :func:`vllm_standin` replaces that name,
in each trainer module, by a subclass of TRL's class that keeps all of TRL's code (its ``generate``: gathering the
prompts to the main process and broadcasting the results in server mode, one request per prompt in colocate mode; its
``sync_weights``: every parameter streamed under its vLLM name) and replaces only what starts vLLM (``_init_vllm``):
the server's client (``vllm_client``, main process only) or the colocated engine (``llm``), both over a
:class:`StandInEngine`. A stock
trainer and the plugin's see the same stand-in, as a user's process sees vLLM.

The engine is a copy of the model taken at start (the checkpoint a server or a colocated engine loads), so it
samples from the weights it was last synced with: a sync that did not happen shows in the completions. It samples
with the request's temperature (inverse-CDF draws from its own seeded generator, so two runs whose weights agree to
fp32 noise draw the same tokens) and returns each sampled token's log-probability after temperature
("processed_logprobs") plus fixed noise: a normal draw seeded by the sequence's tokens, ``noise_std`` nats, as if
vLLM's kernels computed other log-probs than training does. TRL's importance-sampling correction then has a ratio
away from 1 to correct. What vLLM does that TRL does not ask for here (top-k/top-p/min-p, repetition penalty,
structured outputs, images, top-N log-probs, tensor parallelism) is refused with the setting's name.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import zlib
from types import SimpleNamespace

__all__ = ["StandInEngine", "VLLMStandIn", "vllm_standin"]

#: The modules that import ``VLLMGeneration`` by name (where TRL 1.16's trainers look it up).
TRAINER_MODULES = ("trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer", "trl.trainer.distillation_trainer")


class StandInEngine:
    """A vLLM engine's part of TRL's contract, on a copy of the model: weights loaded by name, a sync counted when
    TRL resets the prefix cache (the last call of ``sync_weights``), sequences sampled with a temperature.

    ``seed``: the sampling generator's (request ``r``'s row ``i`` draws from ``numpy.random.default_rng([seed, r,
    i])``); ``noise_std``: the standard deviation, in nats, of the noise added to each returned log-probability.
    """

    def __init__(self, model, eos_token_ids: set[int], *, seed: int, noise_std: float, max_model_len: int):
        self.model = copy.deepcopy(model).eval()
        # TRL patches the trainer's model with a forward that calls the original model's (add_fused_lm_head): a copy
        # keeps that closure, so the engine runs the model class's own forward, on its own weights
        vars(self.model).pop("forward", None)
        signature = inspect.signature(type(self.model).forward).parameters
        self._cache_argument = "cache" if "cache" in signature else "past_key_values"  # renamed in transformers 5.24
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.parameters = dict(self.model.named_parameters())
        self.eos_token_ids, self.seed, self.noise_std = eos_token_ids, seed, noise_std
        self.max_model_len = max_model_len
        self.syncs = 0  #: weight syncs completed (every parameter loaded, then the prefix cache reset)
        self.requests = 0  #: generate calls served
        self.sequences = 0  #: sequences sampled
        self.discarded = False  #: weights dropped by ``sleep(level=2)`` and not synced since
        self._loaded: set[str] = set()

    def load_weights(self, weights) -> None:
        """Copy ``(vLLM name, tensor)`` pairs into the engine's parameters (vLLM's ``model.load_weights``)."""
        import torch

        for name, tensor in weights:
            if name not in self.parameters:
                raise KeyError(f"the stand-in engine has no parameter {name!r} (names: {sorted(self.parameters)[:4]})")
            target = self.parameters[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"parameter {name!r}: shape {tuple(tensor.shape)}, the engine's {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor.detach().to(target.device, target.dtype))
            self._loaded.add(name)

    def reset_prefix_cache(self) -> None:
        """The end of TRL's ``sync_weights``: a sync counts when every parameter was loaded since the last one."""
        missing = sorted(set(self.parameters) - self._loaded)
        if self._loaded and missing:
            raise RuntimeError(f"weight sync left {len(missing)} parameters stale, e.g. {missing[:3]}")
        if self._loaded:
            self.syncs += 1
            self.discarded = False
        self._loaded = set()

    def discard_weights(self) -> None:
        """vLLM's ``sleep(level=2)``: the weights are gone until the next sync."""
        import torch

        with torch.no_grad():
            for parameter in self.parameters.values():
                parameter.fill_(float("nan"))
        self.discarded = True

    def sample(self, prompts: list[list[int]], n: int, params: dict) -> list[tuple[list[int], list[float] | None]]:
        """``n`` completions of each prompt, prompt-major: ``(token ids, log-probs or None)`` per completion. Row
        ``i`` of request ``r`` draws from its own generator, so a prompt repeated ``n`` times with ``n=1`` (colocate
        mode) gets the completions of the prompt once with ``n`` (server mode).

        ``params``: vLLM's sampling parameters as TRL sends them (``temperature``, ``max_tokens``, ``logprobs``, and
        the others at their neutral values, see :func:`check_sampling`)."""
        check_sampling(params)
        if self.discarded:
            raise RuntimeError("generate after sleep(level=2) without a weight sync: the engine holds no weights")
        request, self.requests = self.requests, self.requests + 1
        groups: dict[tuple, list[int]] = {}  # the rows of each distinct prompt, sampled as one batch
        for row in range(len(prompts) * n):
            groups.setdefault(tuple(prompts[row // n]), []).append(row)
        results: list = [None] * (len(prompts) * n)
        for prompt, rows in groups.items():
            for row, result in zip(rows, self._sample_prompt(list(prompt), request, rows, params)):
                results[row] = result
        self.sequences += len(results)
        return results

    def _sample_prompt(self, prompt: list[int], request: int, rows: list[int], params: dict) -> list[tuple]:
        """The completions ``rows`` of one prompt, sampled together (one batch, a KV cache)."""
        import numpy as np
        import torch

        temperature, max_tokens = float(params["temperature"]), int(params["max_tokens"])
        max_tokens = max(0, min(max_tokens, self.max_model_len - len(prompt)))
        draws = np.stack([np.random.default_rng([self.seed, request, row]).random(max_tokens) for row in rows])
        tokens, logps = [[] for _ in rows], [[] for _ in rows]
        done = [max_tokens == 0] * len(rows)
        device = next(self.model.parameters()).device
        inputs, cache = torch.tensor([prompt] * len(rows), device=device), None
        with torch.no_grad():
            for step in range(max_tokens):
                output = self.model(input_ids=inputs, use_cache=True, **{self._cache_argument: cache})
                cache = getattr(output, self._cache_argument)
                logprobs = torch.log_softmax(output.logits[:, -1].float() / temperature, dim=-1)
                cdf = logprobs.double().exp().cumsum(-1).cpu().numpy()
                sampled = [min(int(np.searchsorted(c, u * c[-1], side="right")), len(c) - 1) for c, u in
                         zip(cdf, draws[:, step])]  # fmt: skip
                for row, token in enumerate(sampled):
                    if not done[row]:
                        tokens[row].append(token)
                        logps[row].append(float(logprobs[row, token]))
                        done[row] = token in self.eos_token_ids
                if all(done):
                    break
                inputs = torch.tensor(sampled, device=device).unsqueeze(1)
        wanted = params.get("logprobs") is not None
        return [(ids, self._noisy(prompt, ids, lps) if wanted else None) for ids, lps in zip(tokens, logps)]

    def _noisy(self, prompt: list[int], completion: list[int], logps: list[float]) -> list[float]:
        """``logps`` plus fixed noise: ``noise_std`` times normal draws seeded by the sequence's tokens."""
        import numpy as np

        key = [zlib.crc32(np.asarray(ids, dtype=np.int64).tobytes()) for ids in (prompt, completion)]
        noise = np.random.default_rng([self.seed, *key]).standard_normal(len(logps)) * self.noise_std
        return [float(lp + e) for lp, e in zip(logps, noise)]


#: vLLM's sampling parameters at their neutral values: the stand-in samples with a temperature alone.
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": (0, -1, None), "min_p": (0.0, None), "repetition_penalty": 1.0}


def check_sampling(params: dict) -> None:
    """Refuse, naming the setting, what the stand-in does not sample with."""
    for name, neutral in NEUTRAL_SAMPLING.items():
        allowed = neutral if isinstance(neutral, tuple) else (neutral,)
        if params.get(name, allowed[0]) not in allowed:
            raise NotImplementedError(
                f"vLLM stand-in: {name}={params[name]!r} is not sampled here; leave it at {allowed[0]!r}"
            )
    for name in ("structured_outputs", "structured_outputs_regex", "seed"):
        if params.get(name) is not None:
            raise NotImplementedError(f"vLLM stand-in: {name}={params[name]!r} is not supported; leave it unset")
    if params.get("logprobs") not in (None, 0):
        raise NotImplementedError(f"vLLM stand-in: logprobs={params['logprobs']!r} (top-N); TRL asks for 0 or None")
    if float(params.get("temperature", 1.0)) <= 0:
        raise NotImplementedError(f"vLLM stand-in: temperature={params['temperature']!r}; sample with one above 0")


class StandInClient:
    """TRL's ``VLLMClient`` of a running server (``trl vllm-serve`` with ``--logprobs-mode``): what the trainer's
    main process calls on it."""

    def __init__(self, engine: StandInEngine, base_url: str, logprobs_mode: str):
        self.engine, self.base_url, self.logprobs_mode = engine, base_url, logprobs_mode
        self.communicator = None

    def get_server_info(self) -> dict:
        model_config = {"logprobs_mode": self.logprobs_mode, "max_model_len": self.engine.max_model_len}
        return {"model_config": model_config, "weight_transfer_config": {"backend": "stand-in"}}

    def init_communicator(self, device=0) -> None:
        self.communicator = device

    def close_communicator(self) -> None:
        self.communicator = None

    def update_named_params(self, metadata, named_params) -> None:
        """The tensors announced in ``metadata`` (``(name, dtype, shape)``), then streamed in that order."""
        announced = [(name, tuple(shape)) for name, _, shape in metadata]
        streamed = []
        for name, tensor in named_params:  # consumed to the end: under ZeRO-3 each item is a collective
            streamed.append((name, tuple(tensor.shape)))
            self.engine.load_weights([(name, tensor)])
        if streamed != announced:
            raise RuntimeError(f"weight sync streamed {len(streamed)} tensors unlike the {len(announced)} announced")

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def generate(self, prompts, features=None, n=1, generation_kwargs=None, structured_outputs_regex=None, **params):
        """``/v1/completions`` with token ids: ``n`` completions per prompt, prompt-major."""
        if features is not None:
            raise NotImplementedError("vLLM stand-in: image features are not supported")
        if generation_kwargs:
            raise NotImplementedError(f"vLLM stand-in: generation_kwargs={generation_kwargs!r}; leave it unset")
        params["structured_outputs_regex"] = structured_outputs_regex
        results = self.engine.sample(prompts, n, params)
        logprobs = None if params.get("logprobs") is None else [[[lp] for lp in lps] for _, lps in results]
        logprob_ids = None if logprobs is None else [[[token] for token in ids] for ids, _ in results]
        return {
            "prompt_ids": [list(prompt) for prompt in prompts],
            "completion_ids": [ids for ids, _ in results],
            "logprobs": logprobs,
            "logprob_token_ids": logprob_ids,
        }


@dataclasses.dataclass
class Logprob:
    """vLLM's ``Logprob`` of one token (what ``trl.generation.vllm_generation.extract_logprobs`` reads)."""

    logprob: float
    rank: int = 1


@dataclasses.dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class SamplingParams:
    """vLLM's ``SamplingParams``, as TRL's colocate mode builds it (``SamplingParams(**generation_kwargs)``): the
    keyword arguments, kept."""

    def __init__(self, **params):
        self.params = params


class StandInLLM:
    """vLLM's ``LLM`` in colocate mode: what TRL reads (``llm_engine.model_config.max_model_len``, the driver worker's
    ``model.load_weights``) and calls (``generate``, ``reset_prefix_cache``, ``sleep``, ``wake_up``)."""

    def __init__(self, engine: StandInEngine):
        self.engine = engine
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(load_weights=engine.load_weights)))
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=engine.max_model_len),
            model_executor=SimpleNamespace(driver_worker=worker),
        )

    def generate(self, prompts: list[dict], sampling_params: SamplingParams, use_tqdm: bool = True):
        if any("multi_modal_data" in prompt for prompt in prompts):
            raise NotImplementedError("vLLM stand-in: images (multi_modal_data) are not supported")
        params = dict(sampling_params.params)
        n = params.pop("n", 1)
        token_ids = [prompt["prompt_token_ids"] for prompt in prompts]
        results = self.engine.sample(token_ids, n, params)
        outputs = []
        for index, prompt in enumerate(token_ids):
            completions = [
                CompletionOutput(ids, None if lps is None else [{t: Logprob(lp)} for t, lp in zip(ids, lps)])
                for ids, lps in results[index * n : (index + 1) * n]
            ]
            outputs.append(RequestOutput(list(prompt), completions))
        return outputs

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        if level == 2:
            self.engine.discard_weights()

    def wake_up(self, tags=None) -> None:
        pass


class VLLMStandIn:
    """The stand-in of one :func:`vllm_standin` context: its settings, and every ``VLLMGeneration`` TRL built in it
    (``generations``) with its engine (``engines``; in server mode the main process's only).

    ``noise_std``: nats of noise on each returned log-probability; ``seed``: the engines' sampling seed (a colocated
    engine adds its process index, as TRL seeds vLLM); ``logprobs_mode``: what the server reports (TRL warns unless
    ``"processed_logprobs"``)."""

    def __init__(self, noise_std: float, seed: int, logprobs_mode: str):
        self.noise_std, self.seed, self.logprobs_mode = noise_std, seed, logprobs_mode
        self.generations: list = []
        self.engines: list[StandInEngine] = []

    def generation_class(self) -> type:
        """A subclass of TRL's ``VLLMGeneration`` whose ``_init_vllm`` starts this stand-in instead of vLLM."""
        from trl.generation.vllm_generation import VLLMGeneration

        standin = self

        class StandInVLLMGeneration(VLLMGeneration):
            """TRL's ``VLLMGeneration``, everything but vLLM's start: the stand-in's client or engine."""

            def _init_vllm(self):
                standin.start(self)

        return StandInVLLMGeneration

    def start(self, generation) -> None:
        """TRL's ``_init_vllm`` without vLLM: server mode gives the main process a client, colocate mode every
        process an engine; the same errors for a bad mode or tensor-parallel size; every process waits for the rest."""
        accelerator = generation.accelerator
        if generation.mode not in ("server", "colocate"):
            raise ValueError(f"vllm_mode must be either 'server' or 'colocate', got '{generation.mode}'.")
        if generation.mode == "colocate" and accelerator.num_processes % generation.tensor_parallel_size != 0:
            raise ValueError(
                f"tensor_parallel_size ({generation.tensor_parallel_size}) must divide world size "
                f"({accelerator.num_processes}) evenly."
            )
        if generation.tensor_parallel_size > 1:
            raise NotImplementedError("vLLM stand-in: vllm_tensor_parallel_size > 1 is not supported")
        self.generations.append(generation)
        if generation.mode == "server" and accelerator.is_main_process:
            url = generation.server_base_url or f"http://{generation.server_host}:{generation.server_port}"
            generation.vllm_client = StandInClient(self.engine(generation, self.seed), url, self.logprobs_mode)
            generation.vllm_client.init_communicator(device=accelerator.device)
        elif generation.mode == "colocate":
            engine = self.engine(generation, self.seed + accelerator.process_index)
            generation.llm = StandInLLM(engine)
            if generation.enable_sleep_mode:
                generation.llm.sleep(level=2)
            generation._llm_weights_sleeping = generation.enable_sleep_mode
        accelerator.wait_for_everyone()

    def engine(self, generation, seed: int) -> StandInEngine:
        """An engine on a copy of ``generation``'s model, stopping at its tokenizer's and generation config's eos."""
        model = generation.model
        tokenizer = getattr(generation.processing_class, "tokenizer", generation.processing_class)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos_ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        config = model.config.get_text_config()
        max_model_len = generation.max_model_length or config.max_position_embeddings
        engine = StandInEngine(model, eos_ids, seed=seed, noise_std=self.noise_std, max_model_len=max_model_len)
        self.engines.append(engine)
        return engine


@contextlib.contextmanager
def vllm_standin(*, noise_std: float = 0.3, seed: int = 0, logprobs_mode: str = "processed_logprobs"):
    """Inside the context, TRL's trainers generate through :class:`VLLMStandIn` when ``use_vllm=True``: the name
    ``VLLMGeneration`` of each trainer module (:data:`TRAINER_MODULES`) is the stand-in's subclass of TRL's class,
    its ``is_vllm_available`` (where it imports one: DistillationTrainer's) says True, and
    ``trl.generation.vllm_generation.SamplingParams`` (vLLM's, absent without vLLM) is :class:`SamplingParams`.
    Yields the :class:`VLLMStandIn` (its ``generations`` and ``engines``, for a test to read). Build and train the
    trainer inside the context."""
    import importlib

    from trl.generation import vllm_generation

    standin = VLLMStandIn(noise_std, seed, logprobs_mode)
    modules = [importlib.import_module(name) for name in TRAINER_MODULES]
    stand_ins = {"VLLMGeneration": standin.generation_class(), "SamplingParams": SamplingParams}
    stand_ins["is_vllm_available"] = lambda: True  # DistillationTrainer checks it before building VLLMGeneration
    replaced = [(module, "VLLMGeneration") for module in modules]
    replaced += [(module, "is_vllm_available") for module in modules if "is_vllm_available" in module.__dict__]
    replaced.append((vllm_generation, "SamplingParams"))
    saved = [(module, name, module.__dict__.get(name, _ABSENT)) for module, name in replaced]
    try:
        for module, name in replaced:
            setattr(module, name, stand_ins[name])
        yield standin
    finally:
        for module, name, value in saved:
            if value is _ABSENT:
                delattr(module, name)
            else:
                setattr(module, name, value)


_ABSENT = object()
