.PHONY: setup test test-fast up

setup:
	bash scripts/setup.sh

test:
	bash scripts/test.sh

# The inner loop: the unit tier only (tests/tiers.py), no set-up, lint or type-check.
test-fast:
	.venv/bin/pytest -q -m unit

up:
	bash scripts/up.sh
