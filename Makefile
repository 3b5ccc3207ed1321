# The two commands of the README. Both create .venv and install k3 first (CPU torch where there is no GPU).
.PHONY: demo test setup-vm

demo:  ## train k3-tiny on the built-in corpus (a few minutes on a 2-core CPU), print a sample; leaves runs/demo/
	bash scripts/train.sh --out runs/demo $(ARGS)

test:  ## set up and run the test suite (what CI runs); never fails because the system package manager is busy
	bash scripts/test.sh $(ARGS)

setup-vm:  ## the explicit system step: QEMU, guest kernel and disk for the "vm" sandbox tier (root + apt)
	bash scripts/setup_vm.sh
