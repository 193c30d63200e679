from tailrace.cli import entry

entry()
