.PHONY: setup demo test bench
setup:
	bash scripts/setup.sh
demo: setup
	.venv/bin/hetpilot plan --cluster examples/cluster.json --model examples/model.json --batch 144 --microbatch 8
test:
	bash scripts/test.sh
