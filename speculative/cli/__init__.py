"""What generate.py and serve.py share of the command line: its options (options.py), what a run
shows on a terminal (output.py), and the summaries and JSON of results (report.py). The scripts
are its only users; the library never imports it."""
