"""The rule engine behind `autotune advise`, `autotune check` and the rule-driven proposals."""

from autotune.advisor.config_rules import check_config, config_facts
from autotune.advisor.engine import evaluate
from autotune.advisor.findings import Change, Evidence, Finding
from autotune.advisor.moves import patch_config, propose_moves
from autotune.advisor.rulebook import BUILTIN_RULES, Rule, load_rule_file, load_rules
from autotune.advisor.signals import SignalSet

__all__ = [
    "BUILTIN_RULES", "Change", "Evidence", "Finding", "Rule", "SignalSet", "check_config",
    "config_facts", "evaluate", "load_rule_file", "load_rules", "patch_config", "propose_moves",
]
