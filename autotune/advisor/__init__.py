"""The rule engine behind `autotune advise` and `autotune check`.

It knows nothing of the tuner: `autotune.tuning.proposers.rule_moves` turns its findings
into proposals for the hybrid proposer.
"""

from autotune.advisor.config_rules import config_facts
from autotune.advisor.engine import check_config, evaluate
from autotune.advisor.findings import Change, Evidence, Finding
from autotune.advisor.patch import patch_config
from autotune.advisor.rulebook import BUILTIN_RULES, Rule, load_rule_file, load_rules
from autotune.advisor.signals import SignalSet

__all__ = [
    "BUILTIN_RULES", "Change", "Evidence", "Finding", "Rule", "SignalSet", "check_config",
    "config_facts", "evaluate", "load_rule_file", "load_rules", "patch_config",
]
