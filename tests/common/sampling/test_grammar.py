"""common/sampling/grammar.py: masks from JSON schemas and Lark grammars, on the tiny byte-level tokenizer and SmolLM2's.

The property test draws random JSON schemas, walks a generation at random among the allowed tokens until
EOS, and checks that the text parses and validates against its schema.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.sampling.grammar import GrammarCompiler, GrammarError, GrammarMatcher, GrammarSpec
from common.model.loading import LoadedModel, load_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "role": {"enum": ["admin", "user"]},
        "age": {"type": "integer", "minimum": 3, "maximum": 12},
        "score": {"type": "number"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "role", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random", torch.float32)


@pytest.fixture(scope="module")
def compiler(tiny: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(tiny.tokenizer, tiny.model.config.vocab_size)


def _encode(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def _allowed_text(loaded: LoadedModel, matcher: GrammarMatcher) -> set[str]:
    return {loaded.tokenizer.decode([t]) for t in matcher.allowed().nonzero().flatten().tolist()}


def _person(compiler: GrammarCompiler) -> GrammarMatcher:
    return compiler.compile(GrammarSpec.json_schema(PERSON)).matcher()


# --- the grammar's language, token by token ---------------------------------------------------------------


def test_json_object_starts_with_a_brace_and_ends_with_eos_alone(tiny: LoadedModel, compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(GrammarSpec.json_object()).matcher()
    assert _allowed_text(tiny, matcher) == {"{"}
    matcher.accept_all(_encode(tiny, '{"k": [1, true, null, "x"], "o": {}}'))
    eos = tiny.tokenizer.eos_token_id
    assert matcher.finished and matcher.allowed().nonzero().flatten().tolist() == [eos]
    matcher.accept(eos)
    assert matcher.finished and matcher.n_tokens == len(_encode(tiny, '{"k": [1, true, null, "x"], "o": {}}')) + 1


def test_eos_is_allowed_exactly_where_the_text_is_complete(tiny: LoadedModel, compiler: GrammarCompiler) -> None:
    matcher = compiler.compile(GrammarSpec.json_schema({"type": "integer"})).matcher()
    eos = tiny.tokenizer.eos_token_id
    assert not matcher.allowed()[eos]
    matcher.accept_all(_encode(tiny, "42"))
    assert matcher.allowed()[eos] and not matcher.finished  # more digits may follow
    matcher.accept(eos)
    assert matcher.finished and matcher.allowed().nonzero().flatten().tolist() == [eos]
    with pytest.raises(GrammarError, match="only EOS may follow"):
        matcher.accept(_encode(tiny, "7")[0])


def test_enum_allows_only_its_values(tiny: LoadedModel, compiler: GrammarCompiler) -> None:
    matcher = _person(compiler)
    matcher.accept_all(_encode(tiny, '{"name": "ab", "role": "'))
    assert _allowed_text(tiny, matcher) == {"a", "u"}
    with pytest.raises(GrammarError, match="not allowed"):
        matcher.accept_all(_encode(tiny, 'guest"'))
    matcher.accept_all(_encode(tiny, 'user", "age": '))
    assert _allowed_text(tiny, matcher) - set(" \t\n\r") == set("13456789")  # 3..12: no 0, 2 or sign
    with pytest.raises(GrammarError):
        matcher.accept_all(_encode(tiny, "13"))


def test_required_fields_and_nested_objects(tiny: LoadedModel, compiler: GrammarCompiler) -> None:
    matcher = _person(compiler)
    matcher.accept_all(_encode(tiny, "{"))
    assert "}" not in _allowed_text(tiny, matcher)
    matcher.accept_all(_encode(tiny, '"name": "", "role": "admin", "age": 12, "address": {'))
    assert "}" not in _allowed_text(tiny, matcher)  # city is required
    with pytest.raises(GrammarError):
        matcher.accept_all(_encode(tiny, '"street"'))  # additionalProperties: false
    matcher.accept_all(_encode(tiny, '"city": "Oslo"}}'))
    assert matcher.finished


def test_lark_grammar_with_an_embedded_schema(tiny: LoadedModel, compiler: GrammarCompiler) -> None:
    spec = GrammarSpec.lark('start: "call " name " " args\nname: /[a-z]+/\nargs: %json{"type": "object", '
                            '"properties": {"n": {"type": "integer"}}, "required": ["n"]}')
    matcher = compiler.compile(spec).matcher()
    matcher.accept_all(_encode(tiny, 'call add {"n": 3}'))
    assert matcher.finished


def test_invalid_token_leaves_the_state_unchanged(tiny: LoadedModel, compiler: GrammarCompiler) -> None:
    matcher = _person(compiler)
    matcher.accept_all(_encode(tiny, '{"name"'))
    before = matcher.allowed().clone()
    with pytest.raises(GrammarError, match="token 2 of 3"):
        matcher.accept_all(_encode(tiny, ': }'))
    assert matcher.n_tokens == len(_encode(tiny, '{"name"')) and torch.equal(matcher.allowed(), before)


# --- state: fork, rollback, masks_along ---------------------------------------------------------------------

TEXT = '{"name": "Ann", "role": "user", "age": 7, "address": {"city": "Rome"}}'


def _stepped_masks(matcher: GrammarMatcher, tokens: list[int]) -> list[torch.Tensor]:
    rows = []
    for token in tokens:
        rows.append(matcher.allowed().clone())
        if not rows[-1][token]:
            return rows
        matcher.accept(token)
    return rows + [matcher.allowed().clone()]


def test_fork_and_rollback_reach_the_same_masks(tiny: LoadedModel, compiler: GrammarCompiler) -> None:
    tokens = _encode(tiny, TEXT) + [tiny.tokenizer.eos_token_id]
    matcher = _person(compiler)
    matcher.accept_all(tokens[:20])
    fork = matcher.fork()
    fork.accept_all(tokens[20:])
    assert fork.finished and not matcher.finished
    fork.rollback(len(tokens) - 20)
    assert torch.equal(fork.allowed(), matcher.allowed())
    rest = tokens[20:]
    assert torch.equal(torch.stack(_stepped_masks(fork, rest)), torch.stack(_stepped_masks(matcher, rest)))
    with pytest.raises(GrammarError, match="cannot roll back"):
        matcher.rollback(matcher.n_tokens + 1)


@pytest.mark.parametrize("start", [0, 9, 60])
def test_masks_along_equals_stepping_and_keeps_the_state(tiny: LoadedModel, compiler: GrammarCompiler,
                                                         start: int) -> None:
    tokens = _encode(tiny, TEXT) + [tiny.tokenizer.eos_token_id] * 2
    matcher = _person(compiler)
    matcher.accept_all(tokens[:start])
    before = matcher.allowed().clone()
    rows = matcher.masks_along(tokens[start:])
    assert rows.shape == (len(tokens) - start + 1, tiny.model.config.vocab_size)
    assert torch.equal(rows, torch.stack(_stepped_masks(matcher.fork(), tokens[start:])))
    assert matcher.n_tokens == start and torch.equal(matcher.allowed(), before)


def test_masks_along_stops_at_the_first_disallowed_token(tiny: LoadedModel, compiler: GrammarCompiler) -> None:
    tokens = _encode(tiny, '{"name": 5, "role"')
    rows = _person(compiler).masks_along(tokens)
    bad = tokens.index(_encode(tiny, "5")[0])
    assert rows.shape[0] == bad + 1 and not rows[bad, tokens[bad]] and rows[bad - 1, tokens[bad - 1]]
    assert torch.equal(rows, torch.stack(_stepped_masks(_person(compiler), tokens)))


def test_ids_past_the_tokenizer_are_never_allowed(tiny: LoadedModel) -> None:
    wide = GrammarCompiler(tiny.tokenizer, 300)
    matcher = wide.compile(GrammarSpec.lark("start: /(.|\\n)*/")).matcher()  # any text
    allowed = matcher.allowed()
    assert allowed.shape == (300,) and allowed.sum() > 128 and not allowed[len(tiny.tokenizer):].any()
    with pytest.raises(GrammarError):
        matcher.accept(280)
    assert matcher.masks_along([65, 280, 65]).shape == (2, 300)


# --- compiling and refusing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("schema, words", [
    ({"type": "strnig"}, "strnig"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
])
def test_a_bad_schema_is_refused_naming_the_problem(compiler: GrammarCompiler, schema: dict, words: str) -> None:
    with pytest.raises(GrammarError, match="json_schema grammar does not compile") as err:
        compiler.compile(GrammarSpec.json_schema(schema))
    assert words in str(err.value)


def test_bad_specs_are_refused(tiny: LoadedModel, compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError, match="unknown name"):
        compiler.compile(GrammarSpec.lark("start: missing_rule"))
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        GrammarSpec("regex", "a+")
    with pytest.raises(GrammarError, match="not list"):
        GrammarSpec.json_schema([1])  # type: ignore[arg-type]
    with pytest.raises(GrammarError, match="not JSON"):
        GrammarSpec.json_schema({"x": object()})
    for not_a_schema in ("[1, 2", "[1, 2]", "7"):
        with pytest.raises(GrammarError, match="json_schema grammar"):
            compiler.compile(GrammarSpec("json_schema", not_a_schema))
    with pytest.raises(GrammarError, match="smaller"):
        GrammarCompiler(tiny.tokenizer, 10)


def test_compiler_caches_recent_grammars(tiny: LoadedModel) -> None:
    compiler = GrammarCompiler(tiny.tokenizer, 259, cache_size=2)
    first = compiler.compile(GrammarSpec.json_schema(PERSON))
    assert compiler.compile(GrammarSpec.json_schema(PERSON)) is first
    compiler.compile(GrammarSpec.json_object())
    compiler.compile(GrammarSpec.lark('start: "a"'))
    assert compiler.compile(GrammarSpec.json_schema(PERSON)) is not first
    fresh = GrammarCompiler(tiny.tokenizer, 259).compile(GrammarSpec.json_schema(PERSON)).matcher()
    assert torch.equal(fresh.allowed(), first.matcher().allowed())  # the same spec, the same masks


# --- property: random schemas, random walks -----------------------------------------------------------------

NAMES = ("a", "b", "id", "name", "tags", "x_1", "Zé")
LEAVES = st.one_of(
    st.lists(st.text(alphabet='ab xé"\\', max_size=4), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}),
    st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.tuples(st.sampled_from([-2.5, -1, 0, 0.25, 3]), st.sampled_from([0, 0.5, 10, 1000])).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
)


def _objects(children: st.SearchStrategy) -> st.SearchStrategy:
    def with_required(properties: dict) -> st.SearchStrategy:  # all but at most one required: the walk ends early
        return st.sets(st.sampled_from(sorted(properties)), max_size=1).map(lambda optional: {
            "type": "object", "properties": properties, "required": [p for p in properties if p not in optional],
            "additionalProperties": False})
    return st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=4).flatmap(with_required)


def _arrays(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})


def _nested(depth: int) -> st.SearchStrategy:
    """Objects nested at most `depth` deep, with arrays and leaves inside."""
    if depth == 1:
        return _objects(st.one_of(LEAVES, _arrays(LEAVES)))
    inner = st.one_of(LEAVES, _nested(depth - 1), _arrays(st.one_of(LEAVES, _nested(depth - 1))))
    return _objects(inner)


SCHEMAS = _nested(3)
CLOSERS = '"]},'


def _closing_tokens(loaded: LoadedModel, vocab_size: int) -> torch.Tensor:
    """Tokens whose text ends a string, an array, an object or a value: the walk leans on them to finish."""
    closing = torch.zeros(vocab_size, dtype=torch.bool)
    for token in range(len(loaded.tokenizer)):
        closing[token] = any(c in loaded.tokenizer.decode([token]) for c in CLOSERS)
    return closing


def _random_walk(matcher: GrammarMatcher, eos: int, closing: torch.Tensor, seed: int, cap: int) -> list[int]:
    """Uniform among the allowed tokens, half the time among the allowed closing ones; EOS once allowed."""
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    while not matcher.finished and len(tokens) < cap:
        allowed = matcher.allowed()
        if allowed[eos]:
            break
        pool = allowed.nonzero().flatten()
        closers = pool[closing[pool]]
        if len(closers) and torch.rand((), generator=generator) < 0.5:
            pool = closers
        token = int(pool[torch.randint(len(pool), (), generator=generator)])
        matcher.accept(token)
        tokens.append(token)
    assert matcher.allowed()[eos], f"no EOS after {len(tokens)} tokens"
    matcher.accept(eos)
    return tokens


def _check_walk(loaded: LoadedModel, compiler: GrammarCompiler, closing: torch.Tensor, schema: dict,
                seed: int, cap: int) -> None:
    matcher = compiler.compile(GrammarSpec.json_schema(schema)).matcher()
    tokens = _random_walk(matcher, loaded.tokenizer.eos_token_id, closing, seed, cap)
    text = loaded.tokenizer.decode(tokens)
    jsonschema.validate(json.loads(text), schema)
    rows = compiler.compile(GrammarSpec.json_schema(schema)).matcher().masks_along(tokens[:12])
    assert torch.equal(rows, torch.stack(_stepped_masks(compiler.compile(GrammarSpec.json_schema(schema)).matcher(),
                                                        tokens[:12])))


@pytest.fixture(scope="module")
def tiny_closing(tiny: LoadedModel) -> torch.Tensor:
    return _closing_tokens(tiny, tiny.model.config.vocab_size)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31 - 1))
def test_random_walks_validate_against_random_schemas(tiny: LoadedModel, compiler: GrammarCompiler,
                                                      tiny_closing: torch.Tensor, schema: dict, seed: int) -> None:
    _check_walk(tiny, compiler, tiny_closing, schema, seed, cap=4000)


# --- SmolLM2's 49k vocabulary -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_compiler(smollm2: LoadedModel) -> GrammarCompiler:
    return GrammarCompiler(smollm2.tokenizer, smollm2.model.config.vocab_size)


@pytest.mark.smollm2
def test_smollm2_masks_along_a_tokenized_answer(smollm2: LoadedModel, smol_compiler: GrammarCompiler) -> None:
    tokens = _encode(smollm2, TEXT) + [smollm2.tokenizer.eos_token_id]
    matcher = _person(smol_compiler)
    rows = matcher.masks_along(tokens)
    assert rows.shape == (len(tokens) + 1, smollm2.model.config.vocab_size)
    assert torch.equal(rows, torch.stack(_stepped_masks(matcher.fork(), tokens)))
    matcher.accept_all(tokens)
    assert matcher.finished and matcher.n_tokens == len(tokens)


@pytest.fixture(scope="module")
def smol_closing(smollm2: LoadedModel) -> torch.Tensor:
    return _closing_tokens(smollm2, smollm2.model.config.vocab_size)


@pytest.mark.smollm2
@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31 - 1))
def test_smollm2_random_walks_validate(smollm2: LoadedModel, smol_compiler: GrammarCompiler,
                                       smol_closing: torch.Tensor, schema: dict, seed: int) -> None:
    _check_walk(smollm2, smol_compiler, smol_closing, schema, seed, cap=1500)
