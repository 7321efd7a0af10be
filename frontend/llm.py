"""``LLM``: offline batch generation.

    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi!"}])
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.engine_core.validation import validate_request
from tidal.frontend.engine_client import InprocClient
from tidal.frontend.output_processor import OutputProcessor
from tidal.frontend.outputs import RequestOutput
from tidal.frontend.tokenizer import apply_chat_template, encode_prompt, load_tokenizer

if TYPE_CHECKING:
    from tidal.frontend.mp_client import MPSyncClient

logger = logging.getLogger(__name__)

Prompt = str | list[int]


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
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); results in the order of ``prompts``.

        Every prompt and parameter set is validated before any request starts: a bad one raises
        ``ValueError`` and nothing runs.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(prompt_list)} prompts but {len(params_list)} "
                                 "sampling parameter sets")
        encoded = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            text = prompt if isinstance(prompt, str) else None
            try:
                if text is not None and self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True)")
                if params.stop and self.tokenizer is None:
                    raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True)")
                ids = encode_prompt(self.tokenizer, text) if text is not None else list(prompt)
                validate_request(ids, params, self.config)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from exc
            encoded.append((text, ids, params))
        return self._run(encoded, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            apply_chat_template(self.tokenizer, list(conv), add_generation_prompt, chat_template)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, encoded: list[tuple[str | None, list[int], SamplingParams]],
             use_tqdm: bool) -> list[RequestOutput]:
        processor = OutputProcessor(self.tokenizer)
        order: dict[str, int] = {}
        for i, (text, ids, params) in enumerate(encoded):
            rid = str(next(self._ids))
            order[rid] = i
            final = _final_only(params)
            for req in processor.add_request(rid, text, ids, final):
                self.engine.add_request(req)
        results: list[RequestOutput | None] = [None] * len(encoded)
        bar = tqdm(total=len(encoded), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm)
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
                        bar.update(1)
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"in: {n_in / elapsed:.0f} tok/s, "
                                            f"out: {n_out / elapsed:.0f} tok/s", refresh=False)
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


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    for p in prompts:
        if not isinstance(p, str | list | tuple):
            raise ValueError(f"a prompt must be a string or a list of token ids, got "
                             f"{type(p).__name__}")
    return [p if isinstance(p, str) else list(p) for p in prompts]
