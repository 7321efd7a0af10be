"""``LLM``: offline batch generation.

    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi!"}])
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3], "cache_salt": "tenant-a"}])
    beams = llm.beam_search(["The sky is"], BeamSearchParams(beam_width=4, max_tokens=16))
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.control import AddLora, ListLoras, LoRAIds, RemoveLora
from tidal.engine_core.lora_request import LoRARequest
from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.engine_core.validation import validate_request
from tidal.frontend.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    check_beam_width,
    step_position,
)
from tidal.frontend.engine_client import InprocClient
from tidal.frontend.output_processor import OutputProcessor
from tidal.frontend.outputs import RequestOutput
from tidal.frontend.progress import ProgressBar
from tidal.frontend.prompt_inputs import ParsedPrompt, PromptType, parse_prompts
from tidal.frontend.tokenizer import apply_chat_template, encode_prompt, load_tokenizer

if TYPE_CHECKING:
    from tidal.frontend.mp_client import MPSyncClient

logger = logging.getLogger(__name__)

Prompt = PromptType

# One request ready to run: prompt text (for the output), token ids, parameters, salt, and
# the LoRA adapter (None: the base model).
_Encoded = tuple[str | None, list[int], SamplingParams, str | None, LoRARequest | None]


class LLM:
    def __init__(self, model: str | None = None, skip_tokenizer_init: bool = False,
                 multiprocess: bool = False, **kwargs: Any) -> None:
        """``kwargs`` are engine arguments (see ``EngineArgs``). ``skip_tokenizer_init``: take
        token-id prompts only and return token ids without text (for models without a
        tokenizer).

        ``multiprocess``: run the EngineCore in its own process, on the same client as
        ``AsyncLLM`` (a crash there raises ``EngineDeadError`` here instead of taking this
        process down). Off by default: offline batches gain little from the isolation, and
        starting a process costs seconds. ``llm.engine.core`` (the in-process EngineCore, which
        tests inspect) exists only in the default mode.
        """
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        if args.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 is not yet supported by the offline LLM: "
                             "use AsyncLLM.from_engine_args or `tidal serve "
                             "--data-parallel-size N`")
        config = args.create_config()
        self.engine: InprocClient | MPSyncClient
        if not multiprocess:
            self.tokenizer = None if skip_tokenizer_init else load_tokenizer(config.model)
            self.engine = InprocClient(config)
        else:
            from tidal.frontend.mp_client import EngineConnection
            from tidal.frontend.mp_client import MPSyncClient as _MPSyncClient

            conn = EngineConnection.spawn(config)  # starts while the tokenizer loads
            try:
                self.tokenizer = None if skip_tokenizer_init else load_tokenizer(config.model)
                conn.wait_ready()
            except BaseException:
                conn.close()
                raise
            self.engine = _MPSyncClient(conn)
        self.config = self.engine.config
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in the order of ``prompts``. A prompt is text,
        token ids, or a dict ``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` with an
        optional ``"cache_salt"`` (see ``tidal.frontend.prompt_inputs``). ``lora_request``: one
        LoRA adapter for every prompt, or one per prompt (None: the base model); needs the
        engine started with ``enable_lora=True``.

        Every prompt, parameter set and adapter is validated before any request starts: a bad
        one raises ``ValueError`` and nothing runs.
        """
        prompt_list = parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(prompt_list)} prompts but {len(params_list)} "
                                 "sampling parameter sets")
        loras = self._lora_list(lora_request, len(prompt_list))
        encoded: list[_Encoded] = []
        for i, (prompt, params, lora) in enumerate(zip(prompt_list, params_list, loras)):
            try:
                if params.stop and self.tokenizer is None:
                    raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True)")
                ids = self._token_ids(prompt)
                validate_request(ids, params, self.config)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from exc
            encoded.append((prompt.text, ids, params, prompt.cache_salt, lora))
        return self._run(encoded, use_tqdm)

    def _lora_list(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                   n: int) -> list[LoRARequest | None]:
        """One adapter per prompt, each registered with the engine (which checks its files)
        before anything runs."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * n
        else:
            loras = list(lora_request)
            if len(loras) != n:
                raise ValueError(f"got {n} prompts but {len(loras)} LoRA requests")
        seen: set[LoRARequest] = set()
        for i, lora in enumerate(loras):
            if lora is None or lora in seen:
                continue
            if not isinstance(lora, LoRARequest):
                raise ValueError(f"prompt {i}: lora_request must be a LoRARequest or None, got "
                                 f"{type(lora).__name__}")
            if self.config.lora is None:
                raise ValueError(f"prompt {i}: LoRA adapter {lora.lora_name!r} needs the engine "
                                 "started with enable_lora=True")
            try:
                self.add_lora(lora)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from exc
            seen.add(lora)
        return loras

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter (its files checked against the model); False when it was
        registered already. Raises ``LoRAAdapterError`` (a ValueError) for a bad adapter."""
        try:
            return bool(self.engine.call(AddLora(lora_request)))
        except RuntimeError as exc:  # from an engine process: mp_client.ControlCallError
            raise lora_error(exc) from None

    def remove_lora(self, lora_int_id: int) -> bool:
        return bool(self.engine.call(RemoveLora(lora_int_id)))

    def list_loras(self) -> list[int]:
        ids = self.engine.call(ListLoras())
        assert isinstance(ids, LoRAIds)
        return list(ids.ids)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (the forms ``generate`` takes), as vLLM's
        ``LLM.beam_search``; results in the order of ``prompts`` (see
        ``tidal.frontend.beam_search`` for the algorithm and its parameters). The beams of all
        prompts run as one batch per step."""
        check_beam_width(params, self.config.runner.max_logprobs)
        step_params = params.step_params()
        searches: list[tuple[BeamSearch, str | None]] = []
        for i, prompt in enumerate(parse_prompts(prompts)):
            try:
                ids = self._token_ids(prompt)
                validate_request(ids, step_params, self.config)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from exc
            model = self.config.model
            searches.append((BeamSearch(ids, params, model.eos_token_ids, model.max_model_len),
                             prompt.cache_salt))
        bar = ProgressBar(params.max_tokens, "Beam search steps", enabled=use_tqdm)
        try:
            while live := [(s, salt) for s, salt in searches if not s.done]:
                batch: list[_Encoded] = [(None, tokens, step_params, salt, None)
                                         for s, salt in live for tokens in s.step_prompts()]
                outs = self._run(batch, use_tqdm=False)
                pos = 0
                for s, _ in live:
                    n = len(s.live)
                    if s.steps == 0:
                        s.num_cached_tokens = outs[pos].num_cached_tokens
                    s.advance([step_position(o) for o in outs[pos:pos + n]])
                    pos += n
                bar.update(1)
        finally:
            bar.close()
        return [BeamSearchOutput(s.sequences(self.tokenizer), s.num_cached_tokens)
                for s, _ in searches]

    def _token_ids(self, prompt: ParsedPrompt) -> list[int]:
        if prompt.token_ids is not None:
            return prompt.token_ids
        assert prompt.text is not None
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True)")
        return encode_prompt(self.tokenizer, prompt.text)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            apply_chat_template(self.tokenizer, list(conv), add_generation_prompt, chat_template)
            for conv in conversations
        ]
        # Replies: with a reasoning parser, a grammar applies after the reasoning.
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = msgspec.structs.replace(sampling_params, reasoning_first=True)
        else:
            sampling_params = [msgspec.structs.replace(p, reasoning_first=True)
                               for p in sampling_params]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(self, encoded: list[_Encoded], use_tqdm: bool) -> list[RequestOutput]:
        processor = OutputProcessor(self.tokenizer)
        order: dict[str, int] = {}
        for i, (text, ids, params, salt, lora) in enumerate(encoded):
            rid = str(next(self._ids))
            order[rid] = i
            final = _final_only(params)
            for req in processor.add_request(rid, text, ids, final, cache_salt=salt):
                req.lora_request = lora
                self.engine.add_request(req)
        results: list[RequestOutput | None] = [None] * len(encoded)
        bar = ProgressBar(len(encoded), "Processed prompts", enabled=use_tqdm)
        start = time.perf_counter()
        n_in = n_out = 0
        try:
            while len(processor):
                step = self.engine.step()
                processed = processor.process_outputs(step)
                if processed.abort_engine_ids:
                    self.engine.abort_requests(processed.abort_engine_ids)
                n_out += step.num_tokens
                for out in processed.request_outputs:
                    if out.finished:
                        results[order[out.request_id]] = out
                        n_in += len(out.prompt_token_ids)
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.update(1, f"in: {n_in / elapsed:.0f} tok/s, "
                                      f"out: {n_out / elapsed:.0f} tok/s")
        except BaseException:
            # Leave the engine clean so this LLM keeps working after an interrupt.
            for rid in list(processor.requests):
                self.engine.abort_requests(processor.abort_request(rid))
            raise
        finally:
            bar.close()
        return [r for r in results if r is not None]

    def shutdown(self) -> None:
        self.engine.shutdown()


def _final_only(params: SamplingParams) -> SamplingParams:
    if params.output_kind == OutputKind.FINAL_ONLY:
        return params
    import msgspec

    return msgspec.structs.replace(params, output_kind=OutputKind.FINAL_ONLY)


def lora_error(exc: BaseException) -> BaseException:
    """The error of a LoRA control call as the caller should see it: an engine in another
    process reports ``LoRAAdapterError: why`` in a ``ControlCallError``, turned back into the
    ``LoRAAdapterError`` (a ValueError); anything else unchanged."""
    from tidal.engine_core.lora_adapter import LoRAAdapterError

    prefix = f"{LoRAAdapterError.__name__}: "
    text = str(exc)
    if not isinstance(exc, LoRAAdapterError) and text.startswith(prefix):
        return LoRAAdapterError(text[len(prefix):])
    return exc
