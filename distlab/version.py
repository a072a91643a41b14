"""distlab's version: one place for the package, its build (pyproject's hatch version) and what a
checkpoint records that it was saved by. A leaf module, so that code below the package's face can
read it without importing the face."""

__version__ = "0.1.0"
