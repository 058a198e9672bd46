"""Generation rounds of the step-wise trainers: the policy being trained, as the rollout runner sees it.

Every step of every active episode on this process is generated in one *round* (one call to the
trainer's generation backend). With several processes a round is a collective whenever the backend
needs one, and ranks finish their episodes at different steps, so the rule is: **every rank takes
part in the same number of rounds**; a rank whose episodes are all done keeps joining, with nothing
to generate, until every rank is done (:meth:`TrainerPolicy.drain`). What a round is, per backend:

* **vLLM server** (``vllm_mode="server"``): the prompts of all ranks are gathered (their counts may
  differ: a rank with no episode left sends none), the main process sends them to the server, and the
  completions are broadcast back and cut by each rank's own offsets. TRL's own server path slices the
  broadcast result as ``process_index * len(prompts)``, which is only right when every rank sends the
  same number of prompts, so this module runs the round itself through TRL's client. Each request
  carries the step's own sampling seed, so a step's tokens depend on its prompt and seed only (not
  on the number of ranks), and the server's echo of every prompt is compared with what was sent
  (``mismatched_completions``; a mismatch raises).
* **Hugging Face generate under DeepSpeed ZeRO-3 or FSDP**: generation gathers sharded parameters,
  a collective, so an idle rank joins with a one-token throw-away prompt generating one token
  (``generate`` keeps its peers in step with ``synced_gpus``).
* **Hugging Face generate under DDP / one process, vLLM colocated**: no collective inside generation;
  an idle rank only takes part in the one-flag all-gather that tells whether anyone is still busy.

It records, per episode key, the exact token ids it was prompted with and produced (and the
sampling log-probabilities when the backend returns them): these become the training samples.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import DistributedType, broadcast_object_list, gather_object

from ..inference.compact_decode import generate_dropping_finished, row_token_limits
from ..inference.shared_prefix import shared_prefix_generation
from ..policies.base import Policy, PolicyUnavailable, step_token_limit
from .seeded_sampling import mix, seeded_generation, seeded_round_rng

if TYPE_CHECKING:  # pragma: no cover
    from .grpo import StepwiseGRPOTrainer

# requests in flight to a vLLM server during one round (it batches them itself)
SERVER_CONCURRENCY = 64


class CompletionMismatch(PolicyUnavailable):
    """The vLLM server answered a round with completions of other prompts than the ones sent. Checked on the
    main process for every rank's prompts and raised on every rank (a rank stopping alone would leave the
    others waiting in the next collective)."""


class GenerationFailed(PolicyUnavailable):
    """A generation round raised on this rank (the model, the backend). It stops the run rather than crashing
    the batch's episodes: ``act_or_crash`` would otherwise retry them one by one, each retry one more round on
    this rank only, and under several processes the ranks would no longer take part in the same rounds."""


class ServerRoundError(PolicyUnavailable):
    """The main process's requests to the vLLM server failed in a round, after its retries. Raised on every
    rank with the same message (the outcome is broadcast): the others would otherwise wait in the next
    collective until the process group's timeout. It stops the run (``rollout.act_or_crash`` re-raises it,
    the CLI prints it as one line); no episode is recorded as crashed."""


# A round's requests, retried on the main process only (the other ranks wait in the round's one broadcast,
# so every rank still takes part in exactly one collective per round whatever the number of tries).
DEFAULT_REQUEST_TIMEOUT = 300.0  # seconds per HTTP request to the vLLM server (vllm_request_timeout)
DEFAULT_ROUND_RETRIES = 2  # tries after the first (vllm_round_retries)


def bound_server_calls(client, timeout: float) -> None:
    """Bound every HTTP call of TRL's ``VLLMClient`` by ``timeout`` seconds. ``requests`` waits forever
    without one and TRL passes none, so a server that stalls without failing blocked the main process (and,
    through the next collective, every rank) for good. TRL's session also retries a failed read 5 times
    with 2-32 s backoff inside one call; reads are not retried here (the round retries, a known number of
    times), so a stalled server costs at most (vllm_round_retries + 1) x timeout. Connection refusals are
    still retried briefly (a restarting server)."""
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    session = client.session
    if getattr(session, "atommem_timeout", None) is not None:
        session.atommem_timeout = timeout
        return
    request = session.request

    def request_with_timeout(method, url, **kwargs):
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = session.atommem_timeout
        return request(method, url, **kwargs)

    session.atommem_timeout = timeout
    session.request = request_with_timeout  # Session.get/post call self.request
    retry = Retry(total=3, connect=3, read=0, status=0, backoff_factor=0.5, allowed_methods=["POST", "GET"])
    adapter = HTTPAdapter(max_retries=retry, pool_maxsize=SERVER_CONCURRENCY)
    session.mount("http://", adapter)
    session.mount("https://", adapter)


def uses_vllm_server(trainer) -> bool:
    return bool(getattr(trainer, "use_vllm", False)) and getattr(trainer.args, "vllm_mode", None) == "server"


def generation_is_collective(trainer) -> bool:
    """Whether Hugging Face generation gathers sharded parameters (every rank must join every round)."""
    if getattr(trainer, "use_vllm", False):
        return False
    return trainer.accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)


def generation_autocast(trainer):
    """One autocast context around a whole Hugging Face ``generate`` call when the trainer computes in bf16
    (or fp16) through accelerate's autocast (one process or DDP, ``bf16: true``/``auto_bf16``).

    Why: accelerate wraps the model's ``forward`` in its own autocast context, so every decode step
    enters and leaves autocast, and leaving the outermost context empties autocast's cache of cast weights:
    every step casts all fp32 weights to bf16 again. Inside this outer context the per-step contexts are
    nested, so each weight is cast once per ``generate`` call and the cast copy reused. Same dtypes, same
    values. Measured (``atommem bench decode --rows 8 --same-prompt --autocast``): no measurable gain for
    SmolLM2-135M on a 2-core CPU (83 -> 82 ms per step; the casts were cheap next to the matmuls); kept
    because it costs nothing. Elsewhere (fp32, DeepSpeed and FSDP, which manage dtypes themselves) a null
    context."""
    acc = trainer.accelerator
    precision = str(getattr(acc, "mixed_precision", "no"))
    if precision not in ("bf16", "fp16") or generation_is_collective(trainer):
        return contextlib.nullcontext()
    return torch.autocast(device_type=acc.device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


class TrainerPolicy(Policy):
    """The policy being trained: one generation round per step for all of this process's active
    episodes, through the trainer's generation backend (see the module docstring)."""

    name = "trainer"

    def __init__(self, trainer: "StepwiseGRPOTrainer", seed: int = 0):
        self.trainer = trainer
        self.seed = seed  # episode `key` resets with seed + key (rollout.run_rollouts)
        self.tok = trainer.processing_class
        self.steps: dict[Any, list[tuple[list[int], list[int], list[float] | None]]] = {}
        self.ended: list[Any] = []
        self.rounds = 0  # rounds this rank took part in (equal on every rank: tests check it)
        self.generated_prompts = 0
        self.mismatched_completions = 0
        self.prefill_stats: list[dict] = []  # per Hugging Face generate call: prompt vs prefilled tokens

    def start(self, key, task) -> None:
        self.steps[key] = []  # a retried attempt starts its steps again

    def end(self, key) -> None:
        self.ended.append(key)

    # -- one round -------------------------------------------------------------------------------
    def _generate(self, prompt_ids: list[list[int]], row_seeds: list[int], limits: list[int] | None = None):
        """One call of TRL's generation path. With ``seeded_sampling``, Hugging Face ``generate`` gets per-row
        seeds and colocated vLLM a global generator seeded from the round's row seeds (seeded_sampling.py).
        Hugging Face ``generate`` also gets, off DeepSpeed/FSDP, the batch's common prompt prefix prefilled
        once (shared_prefix_generation: in a first round all G episodes of a task read the same prompt),
        rows that have ended leave the batch when the call is greedy, as seeded sampling's is
        (compact_decode.generate_dropping_finished; there each row also stops at its own ``limits`` entry,
        the environment's answer-phase limit), and, in bf16, weights are cast once per call
        (:func:`generation_autocast`). Other paths generate to ``max_completion_length``; :meth:`act` cuts."""
        t = self.trainer
        with contextlib.ExitStack() as stack:
            if t.use_vllm and getattr(t.args, "seeded_sampling", False):  # colocated (a server round goes elsewhere)
                stack.enter_context(seeded_round_rng(row_seeds, t.accelerator.device))
            if not t.use_vllm and not t.use_transformers_continuous_batching:
                if getattr(t.args, "seeded_sampling", False):
                    stack.enter_context(seeded_generation(t, row_seeds))
                if getattr(t.args, "shared_prefix_generation", False) and not generation_is_collective(t):
                    model = t.accelerator.unwrap_model(t.model)
                    stack.enter_context(shared_prefix_generation(model, self.prefill_stats,
                                                                 decode=generate_dropping_finished))
                if limits is not None:
                    stack.enter_context(row_token_limits(limits))
                stack.enter_context(generation_autocast(t))
            return t._generate_single_turn(prompt_ids, None, {}, 1)

    def _throw_away_round(self) -> None:
        """Join a collective generation with one token of prompt and one generated token."""
        t = self.trainer
        config = t.generation_config
        saved = (config.max_new_tokens, getattr(config, "min_new_tokens", None))
        config.max_new_tokens, config.min_new_tokens = 1, None
        try:
            self._generate([[self.tok.eos_token_id]], [0])
        finally:
            config.max_new_tokens, config.min_new_tokens = saved

    def _server_round(self, prompt_ids: list[list[int]], row_seeds: list[int], limits: list[int] | None = None):
        """One round through a vLLM server: (completions, logprobs, whether any rank had prompts)."""
        t = self.trainer
        acc = t.accelerator
        vg = t.vllm_generation
        if t.state.global_step != t._last_loaded_step:  # a collective under ZeRO-3/FSDP: every rank
            vg.sync_weights()
            t._last_loaded_step = t.state.global_step
        limits = limits if limits is not None else [int(vg.max_completion_length)] * len(prompt_ids)
        per_rank = gather_object([list(zip(prompt_ids, row_seeds, limits))])  # one entry per rank, any length
        counts = [len(r) for r in per_rank]
        if sum(counts) == 0:
            return [], None, False
        payload = [None]
        if acc.is_main_process:
            flat = [item for r in per_rank for item in r]
            payload = [self._ask_with_retries(vg, flat)]
            if payload[0][0] == "ok":  # every rank's echoes checked here, so a mismatch stops every rank alike
                echoed = payload[0][1][2]
                bad = [sum(int(echoed[i] != flat[i][0]) for i in range(sum(counts[:r]), sum(counts[:r + 1])))
                       for r in range(len(counts))]
                if any(bad):
                    payload = [("mismatch", bad)]
        broadcast_object_list(payload, from_process=0)
        status, answer = payload[0]
        if status == "error":  # the same message on every rank
            raise ServerRoundError(answer)
        if status == "mismatch":
            self.mismatched_completions += answer[acc.process_index]
            raise CompletionMismatch(f"completions from the vLLM server belong to other prompts than the ones sent "
                                     f"(per rank: {answer}) at global step {t.state.global_step}")
        completions, logprobs, _ = answer
        start = sum(counts[: acc.process_index])
        mine = slice(start, start + len(prompt_ids))
        return completions[mine], logprobs[mine], True

    def _ask_with_retries(self, vg, items: list[tuple[list[int], int, int]]) -> tuple[str, Any]:
        """Main process: the round's requests, tried 1 + ``vllm_round_retries`` times (each request bounded by
        ``vllm_request_timeout``, :func:`bound_server_calls`). ("ok", answer) or ("error", one-line message
        naming the server, the step and what failed). Retrying whole rounds repeats no token: every request
        carries its step's own sampling seed."""
        import time

        t = self.trainer
        retries = int(getattr(t.args, "vllm_round_retries", DEFAULT_ROUND_RETRIES))
        timeout = float(getattr(t.args, "vllm_request_timeout", DEFAULT_REQUEST_TIMEOUT))
        errors = []
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(min(2.0 ** attempt, 10.0))
            try:
                return "ok", self._ask_server(vg, items)
            except Exception as exc:  # noqa: BLE001 - reported to every rank below
                errors.append(" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
        url = getattr(vg.vllm_client, "base_url", "the vLLM server")
        return "error", (f"the vLLM server at {url} failed a generation round at global step {t.state.global_step} "
                         f"({len(items)} prompts) {retries + 1} times (request timeout {timeout:g} s); last error: "
                         f"{errors[-1]}. Training stopped on every rank; its last saved checkpoint is intact: "
                         "rerun the same command with resume_from_checkpoint: true once the server answers")

    @staticmethod
    def _ask_server(vg, items: list[tuple[list[int], int, int]]):
        """Main process: one request per (prompt, seed, token limit), sent concurrently."""
        params = dict(n=1, repetition_penalty=vg.repetition_penalty, temperature=vg.temperature, top_p=vg.top_p,
                      top_k=vg.top_k, min_p=0.0 if vg.min_p is None else vg.min_p, max_tokens=vg.max_completion_length,
                      logprobs=vg.logprobs, structured_outputs_regex=vg.structured_outputs_regex)

        def one(item):
            prompt, seed, limit = item
            # vLLM seeds are 64-bit signed at most
            out = vg.vllm_client.generate(prompts=[prompt], generation_kwargs={**vg.generation_kwargs,
                                                                               "seed": seed % (2**63 - 1)},
                                          **{**params, "max_tokens": int(limit)})
            # per-token top-k logprobs; keep the sampled token's (TRL does the same)
            lps = None if out["logprobs"] is None else [lp[0] for lp in out["logprobs"][0]]
            return out["completion_ids"][0], lps, out["prompt_ids"][0]

        with ThreadPoolExecutor(max_workers=min(SERVER_CONCURRENCY, len(items))) as pool:
            results = list(pool.map(one, items))
        completions = [r[0] for r in results]
        logprobs = None if any(r[1] is None for r in results) else [r[1] for r in results]
        if logprobs is None:
            logprobs = [None] * len(results)
        return completions, logprobs, [r[2] for r in results]

    def _round(self, prompt_ids: list[list[int]], row_seeds: list[int], limits: list[int] | None = None):
        """Generate this rank's prompts (maybe none) in a round every rank joins:
        (completion ids, sampling logprobs or None, whether any rank had prompts)."""
        t = self.trainer
        self.rounds += 1
        if uses_vllm_server(t):
            out = self._server_round(prompt_ids, row_seeds, limits)
        elif t.accelerator.num_processes > 1:
            busy = t.accelerator.gather(torch.tensor([int(bool(prompt_ids))], device=t.accelerator.device))
            if int(busy.max()) == 0:
                out = [], None, False
            elif not prompt_ids:
                if generation_is_collective(t):
                    self._throw_away_round()
                out = [], None, True
            else:
                out = (*self._generate(prompt_ids, row_seeds, limits), True)
        else:
            out = (*self._generate(prompt_ids, row_seeds, limits), bool(prompt_ids))
        self.generated_prompts += len(prompt_ids)
        return out

    def act(self, batch):
        """One round for the batch. Any failure stops the run (:class:`GenerationFailed`, or the server's
        errors, raised alike on every rank): never a per-episode crash, see :class:`GenerationFailed`."""
        try:
            prompt_ids = []
            for _, obs, _ in batch:
                text = self.tok.apply_chat_template(obs, tokenize=False, add_generation_prompt=True)
                prompt_ids.append(self.tok.encode(text, add_special_tokens=False))
            # a step's sampling seed: the episode's reset seed and the step's index in the episode
            row_seeds = [mix(self.seed + key, len(self.steps[key])) for key, _, _ in batch]
            # the environment's answer-phase limit (answer_max_new_tokens) under max_completion_length
            limits = [step_token_limit(info, self.trainer.max_completion_length) for _, _, info in batch]
            completion_ids, logprobs, _ = self._round(prompt_ids, row_seeds, limits)
        except PolicyUnavailable:
            raise
        except Exception as exc:
            t = self.trainer
            raise GenerationFailed(f"generation failed on rank {t.accelerator.process_index} at global step "
                                   f"{t.state.global_step}: {type(exc).__name__}: {exc}") from exc
        # a row past its limit (a backend that generated to max_completion_length) is cut as generation would
        # have cut it; it ends without EOS, so mask_truncated_completions treats it as truncated
        completion_ids = [list(c)[:m] for c, m in zip(completion_ids, limits)]
        texts = self.tok.batch_decode(completion_ids, skip_special_tokens=True)
        for i, (key, _, _) in enumerate(batch):
            lp = None if logprobs is None or logprobs[i] is None else list(logprobs[i])[:limits[i]]
            self.steps[key].append((prompt_ids[i], completion_ids[i], lp))
        return texts

    def drain(self) -> None:
        """Keep joining generation rounds until no process has active episodes."""
        if self.trainer.accelerator.num_processes > 1 or uses_vllm_server(self.trainer):
            while self._round([], [])[2]:
                pass
