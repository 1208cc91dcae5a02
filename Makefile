.PHONY: setup test up

setup:
	bash scripts/setup.sh

test:
	bash scripts/test.sh

up:
	bash scripts/up.sh
