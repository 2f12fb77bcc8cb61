"""gdskit's version, in a module of its own: the probes' reports carry it without importing the
package face (and, through it, the engine)."""

__version__ = "0.1.0"
