"""The spec in TLA+ and TLC beside our checker (`kvstate export tla`, `kvstate check --engine tlc`)."""
