"""One home for the verdict: the acceptance rules are applied by common/spec/acceptance_rules.py's `decide` alone.

Outside common/spec/acceptance_rules.py and common/spec/tree/multipath_rules.py (the rules; the one entry is the first's `decide`),
no module in common/,
edge/, cloud/ or sim/ imports a rule, or reaches one through the module (`acceptance_rules.block_verify`).
What the rules' module also offers for sampling the token rule's residual by queries (`residual`,
`residual_candidates`, `residual_by_rejection`: cloud/residual.py) is not a rule and stays open. Tests call the
rules directly on purpose.
"""

from __future__ import annotations

import ast

from tests.house.test_layout import MODULES

RULES_MODULE = "common.spec.acceptance_rules"
RULES_MODULES = (RULES_MODULE, "common.spec.tree.multipath_rules")  # the rules' home: the entry's module and the multi-path math
RULES = frozenset({"greedy_verify", "token_verify", "block_verify", "sprinter_verify", "greedy_verdict",
                   "token_acceptances", "ACCEPTANCE_RULES", "rule_for",  # rule_for: the entry's own choice of rule
                   "block_stop", "multipath_block_verify", "greedy_tree_verdict"})


def _rule_uses(source: str) -> list[str]:
    """Where `source` imports a rule from the rules' module, or reads one off it."""
    tree = ast.parse(source)
    aliases: set[str] = set()  # names bound to the module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in RULES_MODULES:
            found += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name in RULES]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:  # `from common.spec import x`
            aliases |= {a.asname or a.name for a in node.names
                        if f"{node.module}.{a.name}" in RULES_MODULES}
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name in RULES_MODULES}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in RULES and ast.unparse(node.value) in aliases:
            found.append(f"{node.lineno}: reads {ast.unparse(node)}")
    return sorted(found)


def test_no_rule_is_applied_outside_the_one_entry() -> None:
    used = {name: uses for name, path in MODULES.items()
            if name not in RULES_MODULES and (uses := _rule_uses(path.read_text()))}
    assert used == {}


def test_the_entry_applies_them() -> None:
    """`decide` is what reads a rule (a checker that finds nothing proves nothing: it must see this one)."""
    source = MODULES[RULES_MODULE].read_text()
    entry = next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == "decide")
    called = {ast.unparse(node.func) for node in ast.walk(entry) if isinstance(node, ast.Call)}
    assert {"greedy_verdict", "token_acceptances", "rule_for", "greedy_tree_verdict", "multipath_block_verify"} <= called


def test_the_rule_catches_planted_uses_and_spares_the_rest() -> None:
    planted = """
from common.spec.acceptance_rules import block_verify, residual
from common.spec.acceptance_rules import decide, rule_for
from common.spec import acceptance_rules as rules
from common.spec.tree.multipath_rules import multipath_block_verify
import common.spec.acceptance_rules
n = rules.token_verify
m = common.spec.acceptance_rules.rule_for
fine = rules.residual_by_rejection, decide
"""
    assert _rule_uses(planted) == ["2: imports block_verify", "3: imports rule_for",
                                   "5: imports multipath_block_verify", "7: reads rules.token_verify",
                                   "8: reads common.spec.acceptance_rules.rule_for"]
