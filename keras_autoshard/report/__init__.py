"""Reports: what the compiler did with a plan, read off the compiled program."""
