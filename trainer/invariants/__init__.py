"""A run's invariants, checked from what each step trains (rules.py) and audited from a finished
run's files (audit.py). Pure logic: no engine, no config object, no runner; trainer/run/
invariant_watch.py feeds a step's trained samples in and reports what it finds."""
from trainer.invariants.draws import RULES as DATA_RULES
from trainer.invariants.rules import RULES as SAMPLE_RULES

RULES = SAMPLE_RULES + DATA_RULES   # every rule a run reports as invariants/<rule>
