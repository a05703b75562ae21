"""The harmony sim's reading of the rendered ``functions`` namespace (backends/sim/harmony.py).

The texts are openai-harmony's renderings, copied verbatim: a parameters schema with a top-level
``description`` puts it on the ``type`` line as a comment and the ``{`` on a line of its own (a
description of several lines: the first one commented, the others bare); so does a property whose
object (or array items) schema has a description.
"""

from __future__ import annotations

from backends.sim.harmony import function_args, function_descriptions

# tools: lookup (a pydantic-style schema: described, as the Agents SDK's as_tool sends it), nest (a
# description of two lines, one with a brace; described nested objects), noargs, plain (no description),
# empty (an empty description: openai-harmony leaves a space after its `//`, the \x20)
RENDERED = """# Tools

## functions

namespace functions {

// Look a city up
type lookup = (_: // Arguments of the lookup.
{
// the city
city: string,
days: number,
}) => any;

// Nest things
type nest = (_: // Top.
Second line {
{
// inner
opts:     // inner
{
    x?: string,
    },
arr:     // item d
{
    y?: string,
    }[],
flat: {
    z?: string,
    }[],
}) => any;

// Takes nothing
type noargs = () => any;

// Plain one
type plain = (_: {
a: string,
}) => any;

// Empty but described
type empty = (_: //\x20
{
}) => any;

} // namespace functions"""


def test_a_described_parameters_schema_is_read() -> None:
    assert function_args(RENDERED) == {
        "lookup": {"city": "sim", "days": 1},
        "nest": {"opts": {}, "arr": [], "flat": []},
        "noargs": {},
        "plain": {"a": "sim"},
        "empty": {},
    }


def test_descriptions_of_described_parameters_schemas() -> None:
    assert function_descriptions(RENDERED) == {"lookup": "Look a city up", "nest": "Nest things", "noargs": "Takes nothing",
                                               "plain": "Plain one", "empty": "Empty but described"}
