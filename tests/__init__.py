"""The tests, laid out like the source: tests/model/ tests model/, tests/speculative/verify/
tests speculative/verify/, tests/weights/ tests weights/, tests/scripts/ the command lines
(generate.py, serve.py, train.py), tests/benchmarks/ and tests/docs/ what is checked of those
folders. Shared helpers live in tests/support/ (imported as ``tests.support.X``); conftest.py
here sets the session up for every folder; tests/bugs/ holds the public-bug examples that
``python -m speculative.prove`` loads by path (no tests of their own).

Every folder is a package (an ``__init__.py``), so a test module's name is its dotted path from
the repository root (``tests.speculative.verify.test_token``) and pytest puts the repository
root on ``sys.path``, which is what makes ``tests.support`` and the scripts importable."""
