"""Statistical tests of the verification rules in common/spec/acceptance_rules.py.

The rules are checked for what they promise, not for how they compute it:

* token and block verification are lossless: decoding with them emits tokens distributed exactly as
  the target model, checked by chi-square on the joint law of the first two emitted tokens, with
  context-dependent (prefix-dependent) draft and target tables;
* negative controls: deliberately wrong variants of the rules fail the very same check, so the
  check has the power to catch the mistakes it is meant to catch;
* block verification accepts at least as many draft tokens as token verification;
* at temperature 0 greedy, token and block verification agree exactly;
* SPRINTER's output law at a position is eta * p_draft + (1 - eta) * p_target (research.md, section 1).

Every test uses fixed seeds, so results are deterministic.
"""

from __future__ import annotations

import bisect
import math
import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from common.sampling.distributions import SamplingParams, logits_to_probs, sample
from common.spec.acceptance_rules import (
    block_verify,
    greedy_verdict,
    greedy_verify,
    residual,
    sprinter_verify,
    token_verify,
)

P_PASS = 1e-3  # a lossless rule must not be rejected at this level
P_POWER = 1e-6  # a wrong rule must be rejected at this level


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """All tensors here are tiny: torch's intra-op thread pool only adds wake-up latency, which on a
    busy 2-core machine reaches milliseconds per op (e.g. a [5, 7] softmax). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------
# Context-dependent draft / target tables
# --------------------------------------------------------------------------------------------


class PrefixTables:
    """Fixed random distributions p_draft(. | prefix) and p_target(. | prefix) for every prefix.

    A prefix (a tuple of token ids) is identified by its row id: (V^len - 1) / (V - 1) + base-V code.
    Rows are generated lazily, each from its own seeded generator, so a row's content depends only
    on (seed, prefix) -- not on which other prefixes were visited, nor in what order.
    Each distribution is softmax(scale * N(0, 1) logits); with `zero_frac` > 0 a random part of the
    vocabulary is cut to probability 0 (as top-k / top-p truncation does), the argmax always kept.
    """

    def __init__(self, vocab: int, seed: int, draft_scale: float = 1.0, target_scale: float = 1.0,
                 zero_frac: float = 0.0) -> None:
        self.vocab = vocab
        self.seed = seed
        self.draft_scale = draft_scale
        self.target_scale = target_scale
        self.zero_frac = zero_frac
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor, list[float], list[float]]] = {}

    def row_id(self, length: int, code: int) -> int:
        return (self.vocab ** length - 1) // (self.vocab - 1) + code

    def _distribution(self, gen: torch.Generator, scale: float) -> torch.Tensor:
        logits = torch.randn(self.vocab, generator=gen, dtype=torch.float64) * scale
        if self.zero_frac > 0:
            cut = torch.rand(self.vocab, generator=gen, dtype=torch.float64) < self.zero_frac
            cut[logits.argmax()] = False
            logits = logits.masked_fill(cut, -math.inf)
        return torch.softmax(logits, dim=-1).float()  # float32, as logits_to_probs returns

    def _row(self, row: int):
        entry = self._rows.get(row)
        if entry is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + row)
            draft = self._distribution(gen, self.draft_scale)
            target = self._distribution(gen, self.target_scale)
            draft64 = draft.double() / draft.double().sum()
            entry = (draft, target, draft64.cumsum(0).tolist(), draft.tolist())
            self._rows[row] = entry
        return entry

    def draft(self, row: int) -> torch.Tensor:
        return self._row(row)[0]

    def target(self, row: int) -> torch.Tensor:
        return self._row(row)[1]

    def target64(self, row: int) -> np.ndarray:
        t = self.target(row).double()
        return (t / t.sum()).numpy()

    def sample_draft(self, row: int, u: float) -> int:
        """Inverse-CDF sample from p_draft(. | prefix) with a uniform u; never a zero-probability token."""
        _, _, cdf, probs = self._row(row)
        x = bisect.bisect_right(cdf, u)
        if x >= self.vocab or probs[x] == 0.0:  # u beyond the rounded total mass
            x = max(i for i in range(self.vocab) if probs[i] > 0.0)
        return x

    def target_joint(self, n_tokens: int) -> np.ndarray:
        """Exact law of the first n_tokens target tokens from the empty prefix, flattened base-V."""
        joint = np.ones(1)
        for length in range(n_tokens):
            cond = np.stack([self.target64(self.row_id(length, code)) for code in range(self.vocab ** length)])
            joint = (joint[:, None] * cond).reshape(-1)
        return joint


class Decoder:
    """Speculative decoding on PrefixTables: draft g tokens, verify with `rule`, repeat."""

    def __init__(self, tables: PrefixTables, g: int) -> None:
        self.tables = tables
        self.g = g
        self._blocks: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def draft_block(self, length: int, code: int, rng: random.Random):
        """Draft g tokens after the prefix (length, code); return (tokens list, tokens, p_draft, p_target)."""
        t, V = self.tables, self.tables.vocab
        drafted = []
        for _ in range(self.g):
            x = t.sample_draft(t.row_id(length, code), rng.random())
            drafted.append(x)
            length, code = length + 1, code * V + x
        key = t.row_id(length, code)  # the whole sequence, prefix and block, identifies the inputs
        block = self._blocks.get(key)
        if block is None:
            rows = []
            for _ in range(self.g + 1):  # walk back from the end of the block to its start
                rows.append(t.row_id(length, code))
                length, code = length - 1, code // V
            rows.reverse()
            block = (torch.tensor(drafted), torch.stack([t.draft(r) for r in rows[:-1]]),
                     torch.stack([t.target(r) for r in rows]))
            self._blocks[key] = block
        return (drafted, *block)

    def first_tokens(self, rule, n_samples: int, n_tokens: int, seed: int) -> tuple[np.ndarray, float]:
        """Counts of the first n_tokens emitted tokens (flattened base-V) over n_samples decodings.

        Rounds continue from the emitted prefix until n_tokens exist, as real decoding does.
        Also returns the mean number of rounds per decoding.
        """
        V = self.tables.vocab
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        counts = np.zeros(V ** n_tokens, dtype=np.int64)
        rounds = 0
        for _ in range(n_samples):
            out: list[int] = []
            code = 0
            while len(out) < n_tokens:
                drafted, tokens, p_draft, p_target = self.draft_block(len(out), code, rng)
                n_accepted, next_token = rule(tokens, p_draft, p_target, gen)
                assert 0 <= n_accepted <= self.g
                rounds += 1
                for tok in drafted[:n_accepted] + [next_token]:
                    out.append(tok)
                    code = code * V + tok
            idx = 0
            for tok in out[:n_tokens]:
                idx = idx * V + tok
            counts[idx] += 1
        return counts, rounds / n_samples


def chisquare_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells of expected count < 5 are pooled.

    A cell of probability 0 must be empty: a sampler that emits an impossible outcome is wrong
    whatever the statistic says.
    """
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    impossible = probs == 0
    assert counts[impossible].sum() == 0, f"emitted outcomes of probability 0: {np.flatnonzero(counts * impossible)}"
    probs = probs[~impossible] / probs[~impossible].sum()
    obs = counts[~impossible]
    exp = probs * obs.sum()
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    return float(chisquare(obs, exp).pvalue)


# --------------------------------------------------------------------------------------------
# Deliberately wrong rules (negative controls)
# --------------------------------------------------------------------------------------------


def _uniform(gen: torch.Generator) -> float:
    return torch.rand((), generator=gen, dtype=torch.float64).item()


def wrong_token_resample_target(draft_tokens, p_draft, p_target, gen):
    """Token verification that resamples from p_target, not the residual, after a rejection."""
    for i, x in enumerate(draft_tokens.tolist()):
        if _uniform(gen) * p_draft[i, x].item() > p_target[i, x].item():
            return i, sample(p_target[i], gen)
    return len(draft_tokens), sample(p_target[-1], gen)


def _block_variant(draft_tokens, p_draft, p_target, gen, *, tokenwise_residual: bool, first_failure: bool):
    """The block verification algorithm of research.md section 2, with one of two known mistakes."""
    g = len(draft_tokens)
    p_t, p_d = p_target.double(), p_draft.double()
    p = [1.0]
    for i, x in enumerate(draft_tokens.tolist()):
        p.append(min(p[-1] * p_t[i, x].item() / p_d[i, x].item(), 1.0))
    h = [0.0]
    for i in range(1, g):
        r_i = torch.clamp(p[i] * p_t[i] - p_d[i], min=0.0).sum().item()
        denominator = r_i + 1.0 - p[i]
        h.append(r_i / denominator if denominator > 0 else 1.0)
    h.append(p[g])
    eta = torch.rand(g, generator=gen, dtype=torch.float64).tolist()
    if first_failure:  # wrong: stop at the first failing coin
        tau = 0
        while tau < g and eta[tau] <= h[tau + 1]:
            tau += 1
    else:
        tau = max((i for i in range(1, g + 1) if eta[i - 1] <= h[i]), default=0)
    if tau == g:
        return g, sample(p_target[g], gen)
    if tokenwise_residual:  # wrong: the token-wise residual, ignoring p_tau
        return tau, sample(residual(p_target[tau], p_draft[tau]), gen)
    mass = torch.clamp(p[tau] * p_t[tau] - p_d[tau], min=0.0)
    return tau, sample(mass / mass.sum() if mass.sum() > 0 else p_t[tau], gen)


def wrong_block_tokenwise_residual(draft_tokens, p_draft, p_target, gen):
    return _block_variant(draft_tokens, p_draft, p_target, gen, tokenwise_residual=True, first_failure=False)


def wrong_block_first_failure(draft_tokens, p_draft, p_target, gen):
    return _block_variant(draft_tokens, p_draft, p_target, gen, tokenwise_residual=False, first_failure=True)


def reference_block(draft_tokens, p_draft, p_target, gen):
    """The test's own transcription of the algorithm, without mistakes (sanity check of the variants)."""
    return _block_variant(draft_tokens, p_draft, p_target, gen, tokenwise_residual=False, first_failure=False)


# --------------------------------------------------------------------------------------------
# 1. Losslessness of token and block verification
# --------------------------------------------------------------------------------------------

VOCAB = 4
BLOCK = 3
N_SAMPLES = 20_000
N_CONTROL = 8_000  # the wrong rules are caught with fewer samples already

# Seeds picked (among the first 40) so that the first two tokens often come from the case where the
# block residual differs from the token-wise one (tau = 1 with p_1 < 1): on many random tables that
# case is rare and a block rule using the token-wise residual would be hard to catch from two tokens.
# test_negative_controls_have_power proves that these setups catch it.
SETUPS = {
    "dense": dict(vocab=VOCAB, seed=37, draft_scale=1.0, target_scale=1.0),
    "sparse": dict(vocab=VOCAB, seed=14, draft_scale=1.0, target_scale=1.0, zero_frac=0.3),
}


@pytest.fixture(scope="module", params=sorted(SETUPS))
def setup(request):
    tables = PrefixTables(**SETUPS[request.param])
    return request.param, tables, Decoder(tables, BLOCK), tables.target_joint(2)


def test_tables_are_context_dependent_and_differ():
    """The setups are not degenerate: draft differs from target, and both depend on the prefix."""
    for name, kwargs in SETUPS.items():
        t = PrefixTables(**kwargs)
        rows = [t.row_id(0, 0)] + [t.row_id(1, c) for c in range(VOCAB)]
        tv = [0.5 * (t.draft(r) - t.target(r)).abs().sum().item() for r in rows]
        assert min(tv) > 0.05 and np.mean(tv) > 0.2, (name, tv)
        targets = torch.stack([t.target(r) for r in rows[1:]])
        assert (targets - targets.mean(0)).abs().max() > 0.1, name
        if kwargs.get("zero_frac"):
            assert any((t.target(r) == 0).any() for r in rows) and any((t.draft(r) == 0).any() for r in rows)


@pytest.mark.parametrize("rule", [token_verify, block_verify], ids=["token", "block"])
def test_lossless_first_two_tokens(setup, rule):
    name, _, decoder, joint = setup
    counts, rounds = decoder.first_tokens(rule, N_SAMPLES, 2, seed=11)
    p = chisquare_pvalue(counts, joint)
    print(f"{rule.__name__} on {name}: p = {p:.3g}, {rounds:.2f} rounds per 2 tokens")
    assert p > P_PASS, f"{rule.__name__} on {name}: joint of the first two tokens is not the target's (p = {p:.3g})"


@pytest.mark.parametrize("rule", [token_verify, block_verify], ids=["token", "block"])
def test_lossless_with_single_token_blocks(rule):
    """g = 1: the bonus token after a fully accepted block is the second token emitted (with g = 3 it
    never is among the first two), so this covers the bonus-token path of the joint law."""
    tables = PrefixTables(**SETUPS["dense"])
    counts, rounds = Decoder(tables, 1).first_tokens(rule, 10_000, 2, seed=13)
    p = chisquare_pvalue(counts, tables.target_joint(2))
    assert 1.0 < rounds < 2.0  # both outcomes, accepted + bonus and rejected, occur
    assert p > P_PASS, f"{rule.__name__} with g = 1: p = {p:.3g}"


@pytest.mark.parametrize("rule", [wrong_token_resample_target, wrong_block_tokenwise_residual,
                                  wrong_block_first_failure],
                         ids=["token-resample-target", "block-tokenwise-residual", "block-first-failure"])
def test_negative_controls_have_power(setup, rule):
    name, _, decoder, joint = setup
    counts, _ = decoder.first_tokens(rule, N_CONTROL, 2, seed=11)
    p = chisquare_pvalue(counts, joint)
    print(f"{rule.__name__} on {name}: p = {p:.3g}")
    assert p < P_POWER, f"the check failed to catch {rule.__name__} on {name} (p = {p:.3g})"


def test_reference_block_transcription_is_lossless():
    """The negative controls differ from a correct transcription by exactly one mistake each."""
    tables = PrefixTables(**SETUPS["sparse"])
    counts, _ = Decoder(tables, BLOCK).first_tokens(reference_block, 5_000, 2, seed=12)
    assert chisquare_pvalue(counts, tables.target_joint(2)) > P_PASS


# --------------------------------------------------------------------------------------------
# 2. Block verification accepts at least as much as token verification
# --------------------------------------------------------------------------------------------


def _paired_accepted_lengths(decoder: Decoder, n_trials: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = random.Random(seed)
    gen_token = torch.Generator().manual_seed(seed)
    gen_block = torch.Generator().manual_seed(seed + 1)
    token_n = np.empty(n_trials)
    block_n = np.empty(n_trials)
    for k in range(n_trials):
        _, tokens, p_draft, p_target = decoder.draft_block(0, 0, rng)  # the same inputs for both rules
        token_n[k] = token_verify(tokens, p_draft, p_target, gen_token)[0]
        block_n[k] = block_verify(tokens, p_draft, p_target, gen_block)[0]
    return token_n, block_n


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_block_accepts_at_least_as_many_as_token(name):
    decoder = Decoder(PrefixTables(**SETUPS[name]), g=5)
    token_n, block_n = _paired_accepted_lengths(decoder, 4_000, seed=21)
    diff = block_n - token_n
    stderr = diff.std() / math.sqrt(len(diff))
    print(f"{name}: mean accepted token = {token_n.mean():.4f}, block = {block_n.mean():.4f}, "
          f"diff = {diff.mean():.4f} +- {stderr:.4f}")
    assert block_n.mean() >= token_n.mean() - 0.01


def test_block_strictly_better_on_swapped_iid_pair():
    """V = 2, g = 2, i.i.d. draft (1/3, 2/3) and target (2/3, 1/3) at every position.

    Exact expectations: token verification accepts 10/9 tokens per round, block verification 11/9
    (the drafted path "B A" has likelihood ratio 1/2 * 2 = 1, which block verification accepts whole).
    """
    p_draft = torch.tensor([1 / 3, 2 / 3])
    p_target = torch.tensor([2 / 3, 1 / 3])
    g, n_trials = 2, 10_000
    gen_draft = torch.Generator().manual_seed(31)
    gen_token = torch.Generator().manual_seed(32)
    gen_block = torch.Generator().manual_seed(33)
    paths = torch.multinomial(p_draft, n_trials * g, replacement=True, generator=gen_draft).view(n_trials, g)
    pd, pt = p_draft.expand(g, 2), p_target.expand(g + 1, 2)
    token_n = np.array([token_verify(x, pd, pt, gen_token)[0] for x in paths])
    block_n = np.array([block_verify(x, pd, pt, gen_block)[0] for x in paths])
    print(f"mean accepted token = {token_n.mean():.4f} (exact {10 / 9:.4f}), "
          f"block = {block_n.mean():.4f} (exact {11 / 9:.4f})")
    # Standard errors are about 0.009 for each mean.
    assert abs(token_n.mean() - 10 / 9) < 0.04
    assert abs(block_n.mean() - 11 / 9) < 0.04
    assert block_n.mean() > token_n.mean() + 0.05
    # Path "B A" (tokens 1, 0): block verification always accepts both tokens.
    ba = (paths[:, 0] == 1) & (paths[:, 1] == 0)
    assert ba.sum() > 500 and (block_n[ba.numpy()] == 2).all()


# --------------------------------------------------------------------------------------------
# 3. Temperature 0: every lossless rule reduces to greedy verification
# --------------------------------------------------------------------------------------------


def test_temperature_zero_rules_agree():
    greedy = SamplingParams(temperature=0.0)
    gen_case = torch.Generator().manual_seed(41)
    gen_rule = torch.Generator().manual_seed(42)
    seen = set()
    for case in range(400):
        vocab = int(torch.randint(2, 40, (), generator=gen_case))
        g = int(torch.randint(1, 7, (), generator=gen_case))
        n_match = case % (g + 1)  # cycles through all-rejected-at-first ... all-accepted
        p_draft = logits_to_probs(torch.randn(g, vocab, generator=gen_case), greedy)
        draft_tokens = p_draft.argmax(-1)
        target_logits = torch.randn(g + 1, vocab, generator=gen_case)
        for i in range(g):
            x = draft_tokens[i]
            if i < n_match:  # the target's argmax is the draft token
                target_logits[i, x] = target_logits[i].max() + 1.0
            elif i == n_match:  # the target's argmax is some other token
                target_logits[i, x] = target_logits[i].min() - 1.0
        p_target = logits_to_probs(target_logits, greedy)
        expected = (n_match, int(target_logits[n_match].argmax()))
        for rule in (greedy_verify, token_verify, block_verify):
            got = rule(draft_tokens, p_draft, p_target, gen_rule)
            assert got == expected, (case, rule.__name__, got, expected)
        argmax = target_logits.argmax(-1).tolist()  # what the cloud reads of a greedy session
        assert greedy_verdict(draft_tokens.tolist(), argmax) == expected
        sprinter = sprinter_verify(draft_tokens, p_draft, p_target, gen_rule)
        assert greedy_verdict(draft_tokens.tolist(), argmax, only_last=True) == sprinter, case
        seen.add((n_match == 0, n_match == g))
    assert seen >= {(True, False), (False, True), (False, False)}


# --------------------------------------------------------------------------------------------
# 4. SPRINTER
# --------------------------------------------------------------------------------------------

SPRINTER_P_DRAFT = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])
SPRINTER_P_TARGET = torch.tensor([0.10, 0.15, 0.20, 0.30, 0.25])
SPRINTER_P_NEXT = torch.tensor([0.30, 0.10, 0.20, 0.25, 0.15])  # the target after the position (bonus token)


def _sprinter_position(eta: float, n_samples: int, seed: int) -> np.ndarray:
    """Emitted-token counts at one position when a synthetic verifier passes each draft token w.p. eta."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(SPRINTER_P_DRAFT, n_samples, replacement=True, generator=gen)
    passed = torch.rand(n_samples, generator=gen) < eta
    p_draft = SPRINTER_P_DRAFT[None]
    p_target = torch.stack([SPRINTER_P_TARGET, SPRINTER_P_NEXT])
    emitted = drafts.clone()
    for k in torch.nonzero(~passed).flatten().tolist():  # flagged: the block is just this token
        n_accepted, next_token = sprinter_verify(drafts[k:k + 1], p_draft, p_target, gen)
        assert n_accepted in (0, 1)
        if n_accepted == 0:
            emitted[k] = next_token
    return np.bincount(emitted.numpy(), minlength=len(SPRINTER_P_DRAFT))


@pytest.mark.parametrize("eta", [0.0, 0.3, 0.8])
def test_sprinter_output_is_mixture(eta):
    counts = _sprinter_position(eta, 20_000, seed=int(eta * 100) + 51)
    mixture = eta * SPRINTER_P_DRAFT.double().numpy() + (1 - eta) * SPRINTER_P_TARGET.double().numpy()
    p = chisquare_pvalue(counts, mixture)
    assert p > P_PASS, f"eta = {eta}: p = {p:.3g}"


def test_sprinter_mixture_check_has_power():
    counts = _sprinter_position(0.8, 20_000, seed=59)
    target = SPRINTER_P_TARGET.double().numpy()
    draft = SPRINTER_P_DRAFT.double().numpy()
    assert chisquare_pvalue(counts, target) < P_POWER
    assert chisquare_pvalue(counts, 0.6 * draft + 0.4 * target) < P_POWER  # a wrong eta is told apart


def test_sprinter_keeps_the_unchecked_prefix():
    gen = torch.Generator().manual_seed(61)
    outcomes = set()
    for _ in range(500):
        vocab = int(torch.randint(2, 12, (), generator=gen))
        g = int(torch.randint(2, 8, (), generator=gen))
        p_draft = torch.softmax(torch.randn(g, vocab, generator=gen) * 2, -1)
        p_target = torch.softmax(torch.randn(g + 1, vocab, generator=gen) * 2, -1)
        # The earlier tokens need not be likely under the target: they are never checked.
        draft_tokens = torch.multinomial(p_draft, 1, generator=gen).flatten()
        n_accepted, next_token = sprinter_verify(draft_tokens, p_draft, p_target, gen)
        assert g - 1 <= n_accepted <= g
        assert 0 <= next_token < vocab
        outcomes.add(n_accepted - g)
    assert outcomes == {-1, 0}


def test_sprinter_checks_the_flagged_token_exactly():
    """In a g = 3 block, the token at the flagged (last) position follows p_target there, and the
    bonus token after an accepted flagged token follows p_target[g]."""
    g, n_samples = 3, 20_000
    gen = torch.Generator().manual_seed(71)
    p_draft = torch.stack([SPRINTER_P_TARGET, SPRINTER_P_NEXT, SPRINTER_P_DRAFT])
    p_target = torch.stack([SPRINTER_P_DRAFT, SPRINTER_P_DRAFT, SPRINTER_P_TARGET, SPRINTER_P_NEXT])
    earlier = torch.multinomial(p_draft[:2], n_samples, replacement=True, generator=gen).T  # [n, 2]
    last = torch.multinomial(p_draft[2], n_samples, replacement=True, generator=gen)
    at_last = np.zeros(len(SPRINTER_P_DRAFT), dtype=np.int64)
    bonus = np.zeros(len(SPRINTER_P_DRAFT), dtype=np.int64)
    for k in range(n_samples):
        tokens = torch.cat([earlier[k], last[k:k + 1]])
        n_accepted, next_token = sprinter_verify(tokens, p_draft, p_target, gen)
        assert n_accepted >= g - 1
        at_last[int(last[k]) if n_accepted == g else next_token] += 1
        if n_accepted == g:
            bonus[next_token] += 1
    assert chisquare_pvalue(at_last, SPRINTER_P_TARGET.double().numpy()) > P_PASS
    assert chisquare_pvalue(bonus, SPRINTER_P_NEXT.double().numpy()) > P_PASS
    assert chisquare_pvalue(at_last, SPRINTER_P_DRAFT.double().numpy()) < P_POWER
