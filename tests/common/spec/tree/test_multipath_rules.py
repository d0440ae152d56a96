"""The verdict on a draft tree: the tree type, greedy's longest followed path, GBV's reduction to block verification on
one path, and GBV's exactness under sampling when the draft alone decides where to branch (with a power check)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from common.spec.tree import multipath_rules
from common.spec.acceptance_rules import Proposal, block_verify, decide
from common.spec.tree.draft_tree import ROOT, DraftTree
from common.spec.tree.multipath_rules import multipath_block_verify
from common.sampling.distributions import SamplingParams
from tests.exact_distributions import chi_square_pvalue

T1 = SamplingParams(temperature=1.0)
GREEDY = SamplingParams()


@pytest.fixture(autouse=True)
def one_thread():
    """Rows of 4 to 8 tokens: a second intra-op thread only waits on the first (1.5 ms a softmax on a shared box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_tree_knows_its_shape_and_refuses_a_child_before_its_parent() -> None:
    tree = DraftTree([5, 6, 7, 8, 9], [ROOT, 0, ROOT, 0, 3])
    assert tree.children(ROOT) == [0, 2] and tree.children(0) == [1, 3]
    assert tree.depths() == [1, 2, 1, 2, 3]
    assert tree.paths() == [[0, 1], [2], [0, 3, 4]]
    assert tree.primary_chain(0) == [0, 1] and not tree.is_chain
    assert DraftTree.chain([4, 4, 4]) == DraftTree([4, 4, 4], [-1, 0, 1]) and DraftTree.chain([4, 4]).is_chain
    for parents, field in (([ROOT, 1], "parents[1] = 1"), ([ROOT, 2, 0], "parents[1] = 2"),
                           ([-2, 0], "parents[0] = -2"), ([ROOT], "one parent per token")):
        with pytest.raises(ValueError, match=field.replace("[", r"\[")):
            DraftTree([1] * (2 if field != "parents[1] = 2" else 3), parents)


def _random_rows(n: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    return torch.softmax(torch.randn(n, vocab, generator=generator) * 2.0, dim=-1)


def test_one_path_is_block_verification_coin_for_coin() -> None:
    rows = torch.Generator().manual_seed(0)
    for case in range(300):
        g, vocab = 1 + case % 6, 3 + case % 5
        p, q = _random_rows(g + 1, vocab, rows), _random_rows(g, vocab, rows)
        tokens = torch.multinomial(q, 1, generator=rows).flatten()
        ours = multipath_block_verify(DraftTree.chain(tokens.tolist()), q, p, torch.Generator().manual_seed(case))
        theirs = block_verify(tokens, q, p, torch.Generator().manual_seed(case))
        assert (len(ours[0]), ours[1]) == theirs and ours[0] == list(range(theirs[0]))


def test_decide_on_a_chain_tree_is_decide_on_the_chain() -> None:
    rows = torch.Generator().manual_seed(1)
    for case in range(100):
        g, vocab = 1 + case % 5, 5
        logits, q = torch.randn(g + 1, vocab, generator=rows), _random_rows(g, vocab, rows)
        tokens = torch.multinomial(q, 1, generator=rows).flatten().tolist()
        for sampling in (T1, GREEDY):
            chain = decide(Proposal(tokens, lambda v: q), "block", sampling, torch.Generator().manual_seed(case),
                           logits=logits)
            tree = decide(Proposal(tokens, lambda v: q, parents=list(range(-1, g - 1))), "block", sampling,
                          torch.Generator().manual_seed(case), logits=logits)
            assert (tree.n_accepted, tree.next_token) == (chain.n_accepted, chain.next_token)
            assert tree.path == list(range(chain.n_accepted))


def test_greedy_keeps_the_longest_path_the_target_follows_even_a_side_one() -> None:
    #        root -> 0:a -> 1:b          the target's argmax: a after the root, c after a, d after a c, e after a c d
    #                    -> 2:c -> 3:d
    a, b, c, d, e = 10, 11, 12, 13, 14
    tree = Proposal([a, b, c, d], parents=[ROOT, 0, 0, 2])
    argmax = [a, c, 0, d, e]  # rows: root, after 0, after 1, after 2, after 3
    verdict = decide(tree, "block", GREEDY, argmax=argmax)
    assert (verdict.path, verdict.n_accepted, verdict.next_token) == ([0, 2, 3], 3, e)
    nothing = decide(Proposal([b, c], parents=[ROOT, ROOT]), "greedy", T1, argmax=[a, 0, 0])
    assert (nothing.path, nothing.next_token) == ([], a)


def test_a_tree_names_a_method_that_reads_several_paths() -> None:
    tree = Proposal([1, 2], parents=[ROOT, ROOT])
    for method in ("token", "sprinter"):
        with pytest.raises(ValueError, match="reads one path"):
            decide(tree, method, GREEDY, argmax=[1, 0, 0])
    with pytest.raises(ValueError, match="q_rows"):
        decide(tree, "block", T1, torch.Generator(), logits=torch.zeros(3, 4))


class ToyPair:
    """A target and a draft as conditional tables over short prefixes of a small vocabulary (the draft near the
    target, so that acceptances, rejections and side paths all happen). `siblings` says what the alternatives are:
    "draft" (i.i.d. draws from the chain token's own row), "copies" (a point mass on a token a fixed table names for
    the prefix, as a suffix index does, then the draft's alternatives), "other" (draws from another row q' than the
    chain token's, the rule told q'). `told_copy_row` "draft" tells the rule a copy came from the draft's row: wrong."""

    def __init__(self, vocab: int, seed: int, siblings: str = "draft", told_copy_row: str = "point") -> None:
        self.vocab, self.seed = vocab, seed
        self.siblings, self.told_copy_row = siblings, told_copy_row
        self.tables: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = {}

    def rows(self, prefix: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The target's row, the draft's, another draft's (q') and the copy table's token after `prefix`."""
        if prefix not in self.tables:
            generator = torch.Generator().manual_seed(self.seed * 7919 + hash(prefix) % 1_000_003)
            target = torch.softmax(torch.randn(self.vocab, generator=generator) * 1.5, dim=-1)
            other = torch.softmax(torch.randn(self.vocab, generator=generator) * 1.5, dim=-1)
            another = torch.softmax(torch.randn(self.vocab, generator=generator) * 1.5, dim=-1)
            copied = int(torch.randint(self.vocab, (1,), generator=generator))
            self.tables[prefix] = target, 0.4 * target + 0.6 * other, 0.3 * target + 0.7 * another, copied
        return self.tables[prefix]

    def draft_tree(self, generator: torch.Generator, depth: int = 3) -> tuple[DraftTree, list[tuple[int, ...]],
                                                                          torch.Tensor]:
        """A primary chain of `depth` draws from the draft; where the draft is unsure (its top probability under 0.6)
        one or two alternatives (`siblings`), each extended by one more draw when the draft liked it; with copies,
        first a copy of two tokens where the table's token differs from the chain's. Nodes are drawn in index order,
        each branch whole, every decision reading the draft's rows and draws only. Returns the tree, each node's
        prefix and the q row the rule is told for each node."""
        tokens, parents, prefixes, told = [], [], [], []

        def add(parent: int, token: int, row: torch.Tensor) -> int:
            prefix = () if parent == ROOT else prefixes[parent]
            tokens.append(token), parents.append(parent), prefixes.append(prefix + (token,)), told.append(row)
            return len(tokens) - 1

        def draw(parent: int, which: int = 1) -> int:
            row = self.rows(() if parent == ROOT else prefixes[parent])[which]
            return add(parent, int(torch.multinomial(row, 1, generator=generator)), row)

        def copy(parent: int) -> int:
            prefix = () if parent == ROOT else prefixes[parent]
            token = self.rows(prefix)[3]
            row = self.rows(prefix)[1] if self.told_copy_row == "draft" else torch.nn.functional.one_hot(
                torch.tensor(token), self.vocab).float()
            return add(parent, token, row)

        chain = [ROOT]
        for _ in range(depth):
            chain.append(draw(chain[-1]))
        if self.siblings == "copies":
            for parent, child in zip(chain[:-1], chain[1:]):
                if self.rows(() if parent == ROOT else prefixes[parent])[3] != tokens[child]:
                    copy(copy(parent))
        for parent in chain[:-1]:
            q = self.rows(() if parent == ROOT else prefixes[parent])[1]
            for _ in range(int(q.max() < 0.6) + int(q.max() < 0.4)):
                if self.siblings == "without":
                    alternative = self._draw_without(parent, q, [t for t, up in zip(tokens, parents) if up == parent],
                                                     add, generator)
                    continue
                alternative = draw(parent, 2 if self.siblings == "other" else 1)
                if q[tokens[alternative]] > 0.2:
                    draw(alternative)
        return DraftTree(tokens, parents), prefixes, torch.stack(told)

    def _draw_without(self, parent: int, q: torch.Tensor, taken: list[int], add, generator: torch.Generator) -> int:
        """A draw from q without the parent's `taken` children's tokens, renormalised; the rule is told that row
        (or q itself with `told_copy_row` "draft": wrong)."""
        rest = q.clone()
        rest[taken] = 0.0
        rest /= rest.sum()
        return add(parent, int(torch.multinomial(rest, 1, generator=generator)),
                   q if self.told_copy_row == "draft" else rest)

    def first_tokens(self, generator: torch.Generator, n: int = 2) -> tuple[tuple[int, ...], bool]:
        """One round of GBV on a drafted tree, then the target itself where the round gave fewer than `n` tokens;
        and whether the round kept a side path (a node that is not its parent's first child)."""
        tree, prefixes, q = self.draft_tree(generator)
        p = torch.stack([self.rows(())[0]] + [self.rows(prefix)[0] for prefix in prefixes])
        verdict = decide(Proposal(tree.tokens, lambda v: q, parents=tree.parents), "block", T1, generator,
                         logits=p.log())
        out = tuple(tree.tokens[i] for i in verdict.path) + (verdict.next_token,)
        while len(out) < n:
            out += (int(torch.multinomial(self.rows(out)[0], 1, generator=generator)),)
        side = any(tree.children(tree.parents[i])[0] != i for i in verdict.path)
        return out[:n], side

    def law(self, n: int) -> dict[tuple[int, ...], float]:
        laws = {(): 1.0}
        for _ in range(n):
            laws = {prefix + (v,): mass * float(self.rows(prefix)[0][v])
                    for prefix, mass in laws.items() for v in range(self.vocab)}
        return laws


def _pvalues(pair: ToyPair, trials: int) -> tuple[float, float, float]:
    """Chi-square p-values of the first tokens and the first pairs against the target, and how often a side path
    was kept."""
    generator = torch.Generator().manual_seed(pair.seed)
    rounds = [pair.first_tokens(generator) for _ in range(trials)]
    seen = [tokens for tokens, _ in rounds]
    return (chi_square_pvalue(Counter(s[:1] for s in seen), pair.law(1)),
            chi_square_pvalue(Counter(seen), pair.law(2)), sum(side for _, side in rounds) / trials)


@pytest.mark.parametrize("vocab,seed", [(4, 1), (6, 2)])
def test_gbv_on_trees_branched_by_the_draft_is_the_target(vocab: int, seed: int) -> None:
    firsts, pairs, side_paths = _pvalues(ToyPair(vocab, seed), trials=2500)
    assert firsts > 1e-3 and pairs > 1e-3, (firsts, pairs)
    assert side_paths > 0.05  # the alternatives are read, not only the primary chain


def test_the_same_check_rejects_a_rule_that_ignores_the_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    real = multipath_rules.block_stop

    def stop_without_residual(tokens, q, p, generator):
        tau, row = real(tokens, q, p, generator)
        return tau, p[tau]  # the target's own row after the kept prefix, as if nothing had been rejected there

    monkeypatch.setattr(multipath_rules, "block_stop", stop_without_residual)
    firsts, pairs, _ = _pvalues(ToyPair(4, 1), trials=2500)
    assert min(firsts, pairs) < 1e-6, (firsts, pairs)


@pytest.mark.parametrize("siblings", ["copies", "other", "without"])
def test_gbv_is_exact_with_siblings_from_their_own_rows(siblings: str) -> None:
    """A point-mass copy beside the chain's token, siblings drawn from another row q' than their first sibling's, and
    siblings drawn without replacement (the edge's alternatives under sampling): each node a draw from the row the
    rule is told, given its parent's prefix and the nodes before it."""
    firsts, pairs, side_paths = _pvalues(ToyPair(4, 1, siblings), trials=2500)
    assert firsts > 1e-3 and pairs > 1e-3, (firsts, pairs)
    assert side_paths > 0.05


def test_the_same_check_rejects_a_copy_told_as_a_draw_from_the_drafts_row() -> None:
    """Power: a copy the rule takes for a draw from its first sibling's q (its own row is a point mass) biases the
    output toward the copied tokens."""
    firsts, pairs, _ = _pvalues(ToyPair(4, 1, "copies", told_copy_row="draft"), trials=2500)
    assert min(firsts, pairs) < 1e-6, (firsts, pairs)


def test_the_same_check_rejects_draws_without_replacement_told_as_draws_from_q() -> None:
    """Power: alternatives drawn without the tokens already there, told as draws from q itself, bias the output
    against them (a vocabulary of 3, where the removed token is a large share of q; the right row passes there)."""
    firsts, pairs, _ = _pvalues(ToyPair(3, 1, "without"), trials=10000)
    assert firsts > 1e-3 and pairs > 1e-3, (firsts, pairs)
    firsts, pairs, _ = _pvalues(ToyPair(3, 1, "without", told_copy_row="draft"), trials=10000)
    assert min(firsts, pairs) < 1e-6, (firsts, pairs)
