"""``RLM()``'s keywords: rlms' own (``backend``, ``backend_kwargs``, ``other_backends``, ``other_backend_kwargs``,
``max_depth``, ``max_iterations``, ``max_errors``, ``custom_system_prompt``, ``custom_tools``, ``custom_sub_tools``,
``persistent``, ``verbose``) and hyflow's settings grouped in ``agent_config`` (`AgentConfig`), ``sandbox`` (a
`SandboxConfig` or a backend) and ``callbacks`` (`Callbacks`). The grouped form builds the same agent as the
flat keywords ``RLM()`` took before (the old code, kept here as the reference, over 1,728 combinations); a
keyword ``RLM()`` does not take is a TypeError naming it."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from workers.agents.llm import EngineLLM
from workers.agents.scripted import ReplayScript, scripted_generate
from workers.rlm.agent import AgentConfig
from workers.rlm.callbacks import Callbacks
from workers.rlm.inference import RLM
from workers.rlm.prompts import PromptConfig
from workers.sandbox import ReplSandbox, SandboxConfig

RLMS_KEYWORDS = ("max_depth", "max_iterations", "max_errors", "custom_system_prompt")
PROMPT_FIELDS = {
    "prompt_style": "style",
    "system_prompts": "system_prompts",
}  # former keyword -> PromptConfig


def old_config(
    agent_config: AgentConfig | None = None,
    *,
    max_depth=None,
    max_iterations=None,
    temperature=None,
    max_new_tokens=None,
    max_total_tokens=None,
    max_cost_usd=None,
    prices=None,
    max_errors=None,
    max_concurrent_subcalls=None,
    final_answer_on_exhaustion=None,
    custom_system_prompt=None,
    system_prompts=None,
    prompt_style=None,
    tool_format=None,
) -> AgentConfig:
    """The agent ``RLM()`` built from its former flat keywords (its old ``__init__``, as it was)."""

    def given(value, default):
        return default if value is None else value

    cfg = agent_config or AgentConfig()
    return replace(
        cfg,
        max_depth=given(max_depth, cfg.max_depth),
        max_iterations=given(max_iterations, cfg.max_iterations),
        temperature=given(temperature, cfg.temperature),
        max_new_tokens=given(max_new_tokens, cfg.max_new_tokens),
        max_total_tokens=given(max_total_tokens, cfg.max_total_tokens),
        max_cost_usd=given(max_cost_usd, cfg.max_cost_usd),
        prices=given({m: list(p) for m, p in prices.items()} if prices is not None else None, cfg.prices),
        max_errors=given(max_errors, cfg.max_errors),
        max_concurrent_subcalls=given(max_concurrent_subcalls, cfg.max_concurrent_subcalls),
        tool_format=given(tool_format, cfg.tool_format),
        final_answer_on_exhaustion=given(
            final_answer_on_exhaustion, cfg.final_answer_on_exhaustion if agent_config is not None else True
        ),
        prompt=replace(
            cfg.prompt,
            custom_system_prompt=given(custom_system_prompt, cfg.prompt.custom_system_prompt),
            system_prompts=given(system_prompts, cfg.prompt.system_prompts),
            style=given(prompt_style, cfg.prompt.style),
        ),
    )


def grouped(agent_config: AgentConfig | None = None, **flat) -> dict:
    """The same call in today's form (docs/rlm.md): rlms' keywords stay keywords; a former hyflow keyword
    ``x=v`` is the field ``x`` of ``agent_config`` (without one: ``AgentConfig(final_answer_on_exhaustion=True)``,
    the agent ``RLM()`` runs by default)."""
    kwargs = {k: flat.pop(k) for k in RLMS_KEYWORDS if flat.get(k) is not None}
    fields = {k: v for k, v in flat.items() if v is not None}
    if fields:
        base = agent_config if agent_config is not None else AgentConfig(final_answer_on_exhaustion=True)
        prompt = {PROMPT_FIELDS[k]: fields.pop(k) for k in PROMPT_FIELDS if k in fields}
        agent_config = replace(base, **fields, prompt=replace(base.prompt, **prompt))
    if agent_config is not None:
        kwargs["agent_config"] = agent_config
    return kwargs


TRAINED = AgentConfig(  # an agent_config that sets every field the keywords touch to something else
    max_depth=2,
    max_iterations=3,
    max_errors=4,
    temperature=0.6,
    max_new_tokens=32,
    max_total_tokens=5000,
    max_concurrent_subcalls=3,
    prices={"*": [1.0, 2.0]},
    child_max_iterations=2,
    prompt=PromptConfig(style="compact", custom_system_prompt="T", system_prompts={0: "root"}),
)
AXES = {
    "agent_config": [None, TRAINED, replace(TRAINED, final_answer_on_exhaustion=True)],
    # rlms' keywords
    "max_depth": [None, 0],
    "max_iterations": [None, 5],
    "max_errors": [None, 2],
    "custom_system_prompt": [None, "S {context_info}"],
    # former hyflow keywords, now AgentConfig's (and PromptConfig's) fields
    "final_answer_on_exhaustion": [None, True, False],
    "prompt": [{}, {"prompt_style": "full"}, {"system_prompts": {1: "child"}}],
    "budget": [{}, {"prices": {"m": (0.5, 1.5)}, "max_cost_usd": 1.0}],
    "turns": [
        {},
        {
            "temperature": 0.0,
            "max_new_tokens": 64,
            "max_total_tokens": 1000,
            "max_concurrent_subcalls": 2,
            "tool_format": "hermes",
        },
    ],
}


def combinations():
    for values in itertools.product(*AXES.values()):
        flat = dict(zip(AXES, values, strict=True))
        for group in ("prompt", "budget", "turns"):
            flat.update(flat.pop(group))
        yield flat


def test_the_grouped_form_builds_the_agent_the_flat_keywords_built(tok):
    engine = scripted_generate(tok, ReplayScript({}))
    n = 0
    for flat in combinations():
        expected = old_config(**flat)
        with RLM(engine, tokenizer=tok, **grouped(**flat)) as rlm:
            assert rlm.config == expected, flat
        n += 1
    assert n == 1728


def test_rlms_keywords_override_the_agent_configs_fields(tok):
    rlm = RLM(
        scripted_generate(tok, ReplayScript({})),
        tokenizer=tok,
        max_depth=0,
        max_iterations=6,
        max_errors=2,
        custom_system_prompt="mine",
        agent_config=TRAINED,
    )
    assert rlm.config == replace(
        TRAINED,
        max_depth=0,
        max_iterations=6,
        max_errors=2,
        prompt=replace(TRAINED.prompt, custom_system_prompt="mine"),
    )
    # without an agent_config the agent is rlms': a last answer is asked for when the turns run out
    assert RLM(scripted_generate(tok, ReplayScript({})), tokenizer=tok).config == AgentConfig(
        final_answer_on_exhaustion=True
    )


def test_the_rlms_call_form_with_every_rlms_keyword():
    """rlms' keywords, as an rlms user writes them (no server is reached while the RLM is built)."""
    url = "http://127.0.0.1:9/v1"
    with RLM(
        backend="openai",
        backend_kwargs={"model_name": "root-model", "base_url": url, "api_key": "none"},
        other_backends=["openai"],
        other_backend_kwargs=[{"model_name": "sub-model", "base_url": url, "api_key": "none"}],
        max_depth=2,
        max_iterations=7,
        max_errors=3,
        custom_system_prompt="Solve it. {context_info}",
        custom_tools={"lookup": lambda key: key, "UNIT": {"tool": "EUR", "description": "the currency"}},
        custom_sub_tools={},
        persistent=True,
        verbose=True,
    ) as rlm:
        cfg = rlm.config
        assert (cfg.max_depth, cfg.max_iterations, cfg.max_errors) == (2, 7, 3)
        assert cfg.prompt.custom_system_prompt == "Solve it. {context_info}"
        assert cfg.final_answer_on_exhaustion  # rlms answers when the turns run out
        assert sorted(rlm.sub_llms) == ["root-model", "sub-model"] and rlm.sub_llm.name == "sub-model"
        assert sorted(rlm.custom_tools) == ["UNIT", "lookup"] and rlm.custom_sub_tools == {}
        assert rlm.session is not None and rlm.callbacks  # persistent; verbose's printer listens


@pytest.mark.parametrize(
    "keyword, value",
    [
        ("temperature", 0.0),  # AgentConfig.temperature
        ("max_new_tokens", 8),  # AgentConfig.max_new_tokens
        ("prompt_style", "compact"),  # PromptConfig.style
        ("tool_format", "hermes"),  # AgentConfig.tool_format
        ("on_iteration", print),  # Callbacks(on_iteration=[...])
        ("sandbox_config", SandboxConfig()),  # sandbox=SandboxConfig(...)
        ("sub_tokenizer", None),  # sub_engine=EngineLLM(engine, tokenizer)
        ("environment", "local"),  # rlms' keyword that hyflow does not take (sandbox=...)
        ("max_iteration", 3),  # a typo
    ],
)
def test_a_keyword_rlm_does_not_take_is_a_type_error_naming_it(tok, keyword, value):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        RLM(scripted_generate(tok, ReplayScript({})), tokenizer=tok, **{keyword: value})


def test_sandbox_is_a_config_of_its_own_sandbox_or_a_backend_to_share(tok):
    engine = scripted_generate(tok, ReplayScript({}))
    rlm = RLM(engine, tokenizer=tok, sandbox=SandboxConfig(timeout_s=7))
    own = rlm.sandbox
    assert isinstance(own, ReplSandbox) and own.config.timeout_s == 7
    rlm.close()  # its own sandbox is closed with it
    assert rlm._sandbox is None

    class Shared:
        config = SandboxConfig()
        closed = False

        def close(self):
            self.closed = True

    shared = Shared()
    with RLM(engine, tokenizer=tok, sandbox=shared) as rlm:
        assert rlm.sandbox is shared
    assert not shared.closed  # a backend passed in is the caller's to close


def test_callbacks_are_a_callbacks_or_an_object_with_the_methods(tok):
    engine = scripted_generate(tok, ReplayScript({}))
    events: list = []
    given = Callbacks(on_final=[events.append])
    with RLM(engine, tokenizer=tok, callbacks=given, verbose=True) as rlm:
        assert rlm.callbacks.listeners["on_final"][0] == events.append
        assert len(rlm.callbacks.listeners["on_final"]) == 2  # and the verbose printer's
    assert given.listeners["on_final"] == [events.append]  # the caller's Callbacks is left as it was

    class Listener:
        def on_subcall(self, event): ...

    listener = Listener()
    with RLM(engine, tokenizer=tok, callbacks=listener) as rlm:
        assert rlm.callbacks.listeners["on_subcall"] == [listener.on_subcall]
    with pytest.raises(TypeError, match="RLM\\(callbacks=...\\): expected a Callbacks"):
        RLM(engine, tokenizer=tok, callbacks=print)


def test_sub_engine_with_a_tokenizer_of_its_own(tok):
    sub = EngineLLM(scripted_generate(tok, lambda prompt: "s"), tok, name="helper")
    with RLM(scripted_generate(tok, ReplayScript({})), sub, tok) as rlm:
        assert rlm.sub_llm is sub and rlm.policy.name == "engine"
