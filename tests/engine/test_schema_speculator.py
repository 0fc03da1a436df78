"""The schema drafter as a Model Runner V2 speculative method (engine/vllm/schema_speculator/): its work per step, on
CPU tensors shaped as vLLM 0.34's request states, with real xgrammar matchers and the tiny model's tokenizer; its
registration against vLLM 0.34's own registry (its Python file, where `make install` put vLLM 0.34's sources); and the
job's `method = "schema"` becoming the registered method's speculative_config."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from batchjson.engine.vllm import schema_speculator
from batchjson.engine.vllm.schema_speculator.steps import NO_GRAMMAR, StepDrafts, read_rows, read_step
from batchjson.schema.drafts import COPY_MAX, Drafter

torch = pytest.importorskip("torch")
xgr = pytest.importorskip("xgrammar")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "plan": {"enum": ["free", "pro"]}},
          "required": ["name", "plan"], "additionalProperties": False}
K, LEN = 6, 256


@pytest.fixture(scope="module")
def kit(tiny_model):
    """(the tiny model's tokenizer, its encode, SCHEMA compiled as vLLM's xgrammar backend compiles it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer)).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    return tokenizer, (lambda text: tokenizer.encode(text, add_special_tokens=False)), compiled


class Runner:
    """vLLM 0.34's request states as the speculator reads them (RequestState.all_token_ids, total_len, prompt_len),
    on CPU tensors, and a greedy target that writes its known answer: each step it takes the longest prefix of the
    request's draft that the answer continues with, then one token of its own, as MRv2's rejection sampler does."""

    def __init__(self, steps: StepDrafts):
        self.steps = steps
        self.tokens = torch.zeros((8, LEN), dtype=torch.int32)
        self.total = torch.zeros(8, dtype=torch.int32)
        self.prompt_len = np.zeros(8, dtype=np.int32)
        self.answers: dict[int, list[int]] = {}
        self.drafts: dict[int, list[int]] = {}

    def add(self, slot: int, prompt: list[int], answer: list[int]) -> None:
        self.steps.add(slot)
        self.tokens[slot, :len(prompt)] = torch.tensor(prompt)
        self.total[slot], self.prompt_len[slot] = len(prompt), len(prompt)
        self.answers[slot], self.drafts[slot] = answer, []

    def output(self, slot: int) -> list[int]:
        return self.tokens[slot, self.prompt_len[slot]:self.total[slot]].tolist()

    def sample(self, slot: int) -> int:
        """The target's tokens for `slot` this step, after its last draft."""
        done, answer = self.output(slot), self.answers[slot]
        taken = 0
        for token in self.drafts[slot]:
            if len(done) + taken < len(answer) and answer[len(done) + taken] == token:
                taken += 1
            else:
                break
        new = answer[len(done):len(done) + taken + 1]
        start = int(self.total[slot])
        self.tokens[slot, start:start + len(new)] = torch.tensor(new, dtype=torch.int32)
        self.total[slot] += len(new)
        return len(new)

    def step(self, slots: list[int], chunk: tuple[int, ...] = (), propose: bool = True) -> np.ndarray:
        """One step of the requests in `slots` (those in `chunk` only prefill: nothing sampled); then, where
        `propose`, the speculator's drafts, as speculator.py reads and writes them."""
        sampled = torch.tensor([0 if s in chunk else self.sample(s) for s in slots], dtype=torch.int32)
        if not propose:
            return np.zeros((0, K))
        idx = torch.tensor(slots, dtype=torch.int64)
        totals, counts, tails = read_step(self.tokens, self.total, idx, sampled, self.steps.window())
        prompt_lens = self.prompt_len[slots]
        unknown = [r for r in self.steps.unknown(slots, prompt_lens, totals) if counts[r] > 0]
        out = np.zeros((len(slots), K), dtype=np.int64)
        self.steps.draft(slots, prompt_lens, totals, counts, tails, read_rows(self.tokens, idx, unknown, totals), out)
        for row, slot in enumerate(slots):
            self.drafts[slot] = out[row].tolist()
        return out


def reference(compiled, encode, prompt: list[int], output: list[int], end: int) -> list[int]:
    """The draft schema/drafts.py's Drafter proposes after `output`, from a matcher advanced through it alone,
    padded to K with the end token, as each row of the speculator's drafts must be."""
    matcher = xgr.GrammarMatcher(compiled)
    for token in output:
        if matcher.is_terminated() or not matcher.accept_token(token):
            matcher = None
            break
    if matcher is not None and matcher.is_terminated():
        draft = []
    else:
        draft = Drafter(encode, K).propose(matcher or NO_GRAMMAR, prompt, output[-COPY_MAX:])
    return draft + [end] * (K - len(draft))


def test_each_step_drafts_what_the_grammar_forces_or_the_prompt_holds_and_the_target_accepts_them(kit):
    tokenizer, encode, compiled = kit
    runner = Runner(StepDrafts(encode, compiled, K, tokenizer.eos_token_id))
    prompts = {2: "Add Omar Khan to the free plan.", 5: "Put Alice Blue on pro now.", 6: "Zed to free."}
    answers = {2: '{"name":" Omar Khan","plan":"free"}', 5: '{"name":" Alice Blue","plan":"pro"}',
               6: '{"name":"Zed","plan":"free"}'}
    for slot, text in prompts.items():
        runner.add(slot, encode(text), encode(answers[slot]) + [tokenizer.eos_token_id])
    slots, steps, accepted = list(prompts), 0, 0
    while any(len(runner.output(s)) < len(runner.answers[s]) for s in slots):
        before = {s: len(runner.output(s)) for s in slots}
        chunk = (6,) if steps == 0 else ()  # slot 6's prompt is still a chunk in the first step: it samples nothing
        out = runner.step(slots, chunk)
        steps += 1
        for row, slot in enumerate(slots):
            accepted += max(len(runner.output(slot)) - before[slot] - 1, 0)
            if slot in chunk or len(runner.output(slot)) >= len(runner.answers[slot]):
                continue
            expected = reference(compiled, encode, encode(prompts[slot]), runner.output(slot), tokenizer.eos_token_id)
            assert out[row].tolist() == expected, (steps, slot)
    assert all(runner.output(s) == runner.answers[s] for s in slots)
    assert accepted > 0.3 * sum(len(a) for a in runner.answers.values())  # forced keys and copied names were taken
    assert steps < max(len(a) for a in runner.answers.values())


def test_a_slot_given_a_new_request_starts_from_its_prompt_and_the_grammars_start(kit):
    tokenizer, encode, compiled = kit
    runner = Runner(StepDrafts(encode, compiled, K, tokenizer.eos_token_id))
    runner.add(3, encode("Omar to free."), encode('{"name":"Omar","plan":"free"}'))
    for _ in range(3):
        runner.step([3])
    runner.add(3, encode("Bob to pro."), encode('{"name":"Bob","plan":"pro"}'))
    out = runner.step([3])
    end = tokenizer.eos_token_id
    assert out[0].tolist() == reference(compiled, encode, encode("Bob to pro."), runner.output(3), end)


def test_tokens_gained_beyond_the_window_are_read_whole_and_a_refused_token_leaves_copies_only(kit):
    tokenizer, encode, compiled = kit
    runner = Runner(StepDrafts(encode, compiled, K, tokenizer.eos_token_id))
    prompt = encode("Add Omar Khan to the free plan.")
    runner.add(1, prompt, encode('{"name":" Omar Khan","plan":"free"}'))
    runner.step([1])
    for _ in range(K + 3):  # steps without drafts (vLLM asks none): more new tokens than the window holds
        runner.drafts[1] = []
        runner.step([1], propose=False)
    assert runner.steps.unknown([1], runner.prompt_len[[1]], runner.total[[1]].numpy()) == [0]
    out = runner.step([1])
    assert out[0].tolist() == reference(compiled, encode, prompt, runner.output(1), tokenizer.eos_token_id)
    # A request whose output its matcher refuses (another grammar's) keeps getting copies from its prompt.
    runner.add(4, prompt, encode("Omar Khan to the free plan") + [tokenizer.eos_token_id])
    for _ in range(4):
        out = runner.step([4])
    assert runner.steps.requests[4].matcher is None
    assert out[0].tolist() == reference(compiled, encode, prompt, runner.output(4), tokenizer.eos_token_id)


def test_the_grammar_refuses_the_filler_so_the_schedulers_masks_end_where_the_known_draft_ends(kit):
    """vLLM's scheduler fills a grammar mask for each drafted position up to the first one the grammar refuses (the
    cost of a drafted step at a full batch): with the end token as filler, only the known part of a draft (forced,
    copied) gets masks; with the last token repeated, masks went on over repeats the grammar takes inside a string.
    The answers are the same either way."""
    tokenizer, encode, compiled = kit
    prompt = encode("Sign up Maximiliana Oberholzer-Wittgenstein to the pro plan.")
    answer = encode('{"name":"Maximiliana Oberholzer-Wittgenstein","plan":"pro"}') + [tokenizer.eos_token_id]

    def masked_rows(end):
        """(drafted positions the scheduler's grammar takes, positions of known drafts, the output)."""
        runner, rows, known = Runner(StepDrafts(encode, compiled, K, end)), 0, 0
        runner.add(0, prompt, answer)
        while len(runner.output(0)) < len(answer):
            draft = runner.step([0])[0].tolist()
            matcher = xgr.GrammarMatcher(compiled)  # the scheduler's: its grammar through the output, then the draft
            for token in runner.output(0):
                matcher.accept_token(token)
            valid = 0
            while valid < K and not matcher.is_terminated() and matcher.accept_token(draft[valid]):
                valid += 1
            rows += valid
            known += (reference(compiled, encode, prompt, runner.output(0), -1) + [-1]).index(-1)
        return rows, known, runner.output(0)

    with_end, known, output = masked_rows(tokenizer.eos_token_id)
    repeated, _, same = masked_rows(None)
    assert output == same == answer
    assert with_end <= known + 1  # the known drafts, and the end token once the JSON is complete
    assert repeated > with_end, (repeated, with_end)


@pytest.fixture
def registry_034():
    """vLLM 0.34's registry of speculative methods: this vLLM's, else its Python file from vLLM 0.34's sources (`make
    install` puts them in the virtualenv: tests/vllm_sources.py), as bench schema-drafter --fake loads it."""
    import vllm_sources
    from bench.schema_drafter import use_registry

    before = sys.modules.get(schema_speculator.REGISTRY)
    try:
        registry = use_registry(vllm_sources.folder("0.34"))
    except SystemExit as e:
        pytest.skip(str(e))
    registry._CUSTOM_CONFIGS.pop(schema_speculator.METHOD, None)  # as in a process the plugin has not run in yet
    yield registry
    sys.modules.pop(schema_speculator.CONFIG.rsplit(".", 1)[0], None)
    if before is None:
        sys.modules.pop(schema_speculator.REGISTRY, None)
    else:
        sys.modules[schema_speculator.REGISTRY] = before


def test_on_vllm_034_the_plugin_registers_the_method_and_its_config_sets_up_a_drafter_without_a_model(registry_034):
    from batchjson.engine import plugin

    assert schema_speculator.METHOD not in registry_034.registered_speculative_methods()
    plugin.register()  # vLLM's call in each of its processes, in a batchjson run or not
    assert schema_speculator.METHOD in registry_034.registered_speculative_methods()
    plugin.register()  # again (a forked process): no "already registered"
    config_cls = registry_034.get_custom_speculator_config_class(schema_speculator.METHOD)
    assert config_cls.speculator_class == "batchjson.engine.vllm.schema_speculator.speculator.SchemaSpeculator"
    target = object()
    spec = types.SimpleNamespace(target_model_config=target, target_parallel_config="tp", num_speculative_tokens=8,
                                 speculator_options={"json_schema": json.dumps(SCHEMA)},
                                 prompt_lookup_min=None, prompt_lookup_max=None)
    config_cls.configure(spec)
    config_cls.apply_options(spec)
    assert spec.draft_model_config is target and spec.num_speculative_tokens == 8
    assert "speculator_options" in config_cls.supported_options
    with pytest.raises(ValueError, match="json_schema only"):
        config_cls.apply_options(types.SimpleNamespace(speculator_options={"schema": "{}"}))


def test_the_job_method_schema_names_the_registered_method_with_the_jobs_grammar(registry_034, tmp_path):
    from batchjson.engine.vllm_engine import engine_settings
    from batchjson.spec import DecodingSpec, ModelSpec, SpeculativeSpec

    speculative = SpeculativeSpec(method="schema", num_speculative_tokens=8, options={"max_model_len": 300})
    (tmp_path / "config.json").write_text("{}")
    choice, kwargs = engine_settings(ModelSpec(path=str(tmp_path)), DecodingSpec(), SCHEMA, speculative, cpu=False)
    config = kwargs["speculative_config"]
    assert config["method"] == schema_speculator.METHOD in registry_034.registered_speculative_methods()
    assert config["num_speculative_tokens"] == 8 and config["max_model_len"] == 300
    assert json.loads(config["speculator_options"]["json_schema"]) == choice.grammar_schema


def test_the_speculator_reads_vllms_request_states_and_writes_each_rows_draft(kit, tiny_model, monkeypatch):
    """speculator.py on Model Runner V2's inputs as vLLM 0.34 passes them (its BaseSpeculator stood in for: this vLLM
    has none), on CPU tensors: the drafts it returns are steps.py's, row for row, each with the odds adaptive
    verification ranks drafts by (a forced string's first); a dummy run drafts nothing."""
    import vllm.tokenizers

    tokenizer, encode, compiled = kit
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.spec_decode.speculator",
                        types.SimpleNamespace(BaseSpeculator=object))
    monkeypatch.setattr(vllm.tokenizers, "cached_tokenizer_from_config", lambda model_config: tokenizer)
    name = "batchjson.engine.vllm.schema_speculator.speculator"
    monkeypatch.setitem(sys.modules, name, None)  # its state now, restored after the test: the module on the stand-in
    del sys.modules[name]                          # base is imported afresh here and forgotten after
    from batchjson.engine.vllm.schema_speculator.speculator import SchemaSpeculator

    ns = types.SimpleNamespace
    config = ns(speculative_config=ns(num_speculative_tokens=K, speculator_options={"json_schema": json.dumps(SCHEMA)},
                                      enable_adaptive_verification=True),
                scheduler_config=ns(max_num_seqs=8), structured_outputs_config=ns(disable_any_whitespace=True),
                model_config=ns(get_vocab_size=lambda: len(tokenizer)))
    runner = Runner(StepDrafts(encode, compiled, K, tokenizer.eos_token_id))
    states = ns(all_token_ids=ns(gpu=runner.tokens), total_len=ns(gpu=runner.total),
                prompt_len=ns(np=runner.prompt_len), req_id_to_index={"a": 2, "b": 5})
    speculator = SchemaSpeculator(config, torch.device("cpu"), req_states=states)
    prompts = {2: "Add Omar Khan to the free plan.", 5: "Put Alice Blue on pro now."}
    for slot, text in prompts.items():
        runner.add(slot, encode(text), encode('{"name":"x","plan":"pro"}'))
        speculator.add_request(slot)
    batch = ns(num_reqs=2, idx_mapping=torch.tensor([5, 2]), idx_mapping_np=np.array([5, 2]))
    for step in range(4):
        expected = runner.step([5, 2])  # the same state, drafted by steps.py alone
        sampled = torch.tensor([1, 1], dtype=torch.int32)  # any count > 0: the lengths say what was added
        drafts = speculator.propose(batch, None, None, None, None, sampled, None, None, None, None, None,
                                    num_speculative_tokens=K)
        assert drafts.tolist() == expected.tolist(), step
        odds = speculator.draft_token_confidence_probs[:2]  # adaptive verification's: forced 1, copies less, fillers 0
        assert set(odds.flatten().tolist()) <= {0.0, 0.75, 1.0}
        assert step or odds[:, 0].tolist() == [1.0, 1.0]  # after the first token: the first key, forced
    assert speculator.propose(batch, *[None] * 10, dummy_run=True).shape == (2, K)
    speculator.on_requests_finished({"a"})
    assert 2 not in speculator.steps.requests and 5 in speculator.steps.requests
