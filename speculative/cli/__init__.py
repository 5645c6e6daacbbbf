"""What the scripts share of the command line: generate.py and serve.py's options (options.py),
what a run shows on a terminal (output.py), the summaries and JSON of results (report.py), the
guard's costs recorded once per machine (costs.py), and train.py's options and parser
(training.py). The scripts are its only users; the library never imports it."""
