"""Serve a model on hyflow's own OpenAI-compatible endpoint (``workers.agents.gateway``), e.g. the policy a run
exported, so the ``openai`` client, ``curl`` and the RLM API's ``openai`` backend use it after training::

    python -m recipes.serve --model runs/openai_agent            # a run folder (its hf_model/), or a HF directory
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "runs/openai_agent", "messages": [{"role": "user", "content": "How many words: red cat"}]}'

The engine is a rollout engine's inference mode (``--engine``: ``native``, the default, ``sglang``, or
``"package.module:Class"``) with its ``for_inference`` options as ``--option key=value`` (the value read as JSON
where it is: ``--option max_num_seqs=32``, ``--option 'engine_kwargs={"context_length": 2048}'``). The chat template is the model's; tool calls are
parsed with ``--tool-parser``. Localhost only unless ``--host`` says otherwise; ``--api-key`` makes requests send
it. The first line printed is ``serving <name> at <url>/v1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import fields

from workers.agents.clients import make_llm
from workers.agents.gateway import Gateway, GatewayConfig
from workers.agents.llm import EngineLLM

__all__ = ["main", "model_directory"]


def model_directory(path: str) -> str:
    """The Hugging Face directory ``path`` names: itself (it has a ``config.json``) or a run folder's
    ``hf_model/``; a ValueError saying what is missing otherwise."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    exported = os.path.join(path, "hf_model")
    if os.path.isfile(os.path.join(exported, "config.json")):
        return exported
    if os.path.isdir(os.path.join(path, "checkpoints")) or os.path.isfile(
        os.path.join(path, "metrics.jsonl")
    ):
        raise ValueError(
            f"--model {path}: a run folder without hf_model/; train with trainer.export_hf=true (its checkpoints "
            "are for resuming, not serving)"
        )
    raise ValueError(f"--model {path}: neither a Hugging Face model directory (config.json) nor a run folder")


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option wants key=value, got {text!r}")
    try:  # a number, true/false, null or a JSON object (SGLang's engine_kwargs={"context_length": 2048})
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a plain string: device=cpu


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipes.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face directory, or a run folder with hf_model/")
    p.add_argument("--engine", default="native", help="a rollout engine: native, or 'package.module:Class'")
    p.add_argument("--option", type=_option, action="append", default=[], help="engine option key=value")
    p.add_argument("--served-model-name", default=None, help="the name requests send (default: --model)")
    defaults = GatewayConfig()
    p.add_argument("--host", default=defaults.host)
    p.add_argument("--port", type=int, default=8000, help="0: a free port")
    p.add_argument(
        "--tool-parser", default=defaults.tool_parser, help="hermes, llama3_json or 'module:Class'"
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-concurrent-requests", type=int, default=defaults.max_concurrent_requests)
    p.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes)
    p.add_argument("--default-max-tokens", type=int, default=defaults.default_max_tokens)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        path = model_directory(args.model)
        name = args.served_model_name or args.model
        config = GatewayConfig(
            **{f.name: getattr(args, f.name) for f in fields(GatewayConfig) if hasattr(args, f.name)},
            model_name=name,
        )
        llm = make_llm(args.engine, {"model_name": path, **dict(args.option)})
        if not isinstance(llm, EngineLLM):  # a chat API client (openai, anthropic, ...): no engine to serve
            raise ValueError(
                f"--engine {args.engine}: a remote chat API, not a rollout engine; serve with native, sglang or "
                "'package.module:Class'"
            )
    except ValueError as e:
        sys.exit(f"error: {e}")
    llm.name = name
    gateway = Gateway(config, default=llm)
    loop = getattr(llm.engine, "event_loop", None) or asyncio.new_event_loop()

    async def serve() -> None:
        url = await gateway.start()
        print(f"serving {name} at {url}/v1", flush=True)
        await asyncio.Event().wait()  # until interrupted

    try:
        loop.run_until_complete(serve())
    except KeyboardInterrupt:
        loop.run_until_complete(gateway.stop())
    finally:
        shutdown = getattr(llm.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()


if __name__ == "__main__":
    main()
