"""A run's invariants, checked from what each step trains (rules.py), the probe of the weights
each sync sent (probe.py), audited from a finished run's files (audit.py). Pure logic: no engine,
no config object, no runner; trainer/run/invariant_watch.py feeds a step's trained samples and
the probe's log-probabilities in and reports what it finds."""
from trainer.invariants.draws import RULES as DATA_RULES
from trainer.invariants.probe import RULE as PROBE_RULE
from trainer.invariants.rules import RULES as SAMPLE_RULES

RULES = SAMPLE_RULES + DATA_RULES + (PROBE_RULE,)   # every rule a run reports as invariants/<rule>
