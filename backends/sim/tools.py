"""Which declared function a plain prompt asks the simulated worker to call.

Under ``tool_choice: "auto"`` the sim calls a function when the last user message mentions a word
of its name or description, so a Codex session, an Agents SDK run or a demo script shows the tool
loop from plain prompts. Markers still win: ``[sim:call=NAME]`` names the calls, and a marker
that scripts the text (``[sim:echo]``, ``[sim:refuse]``, ``[sim:tokens=N]``) asks for no call. Words
are compared lower-cased, names split at ``_``, ``-``, ``.`` and camelCase humps
(``getWeather``, ``get_weather`` -> get, weather); words under three letters, common English words
and the verbs every tool name starts with (get, set, ...) never match; a plural matches its
singular, and a word of four letters or more the longer word it begins (look / lookup). The function whose words the message mentions most is called, the first
declared on a tie; none mentioned, none called.
"""

from __future__ import annotations

import re

# Markers that script the answer's text: with one of them the message asks for that text, not a call.
TEXT_MARKERS = frozenset({"echo", "refuse", "tokens"})
MIN_LETTERS = 3
# Too common to mean a tool: English function words, and the verbs and nouns of tool names generally.
STOP_WORDS = frozenset("""
a about above after again all also am an and any are as at be because been before being below between both but
by can could did do does doing done down during each either else ever every few for from further had has have
having he her here hers him his how however i if in into is it its itself just let like may me might more most
much must my no nor not now of off on once one only or other our out over own please same she should so some such
than that the their them then there these they this those through to too under until up upon us very via was we
were what when where which while who whom why will with within without would yes yet you your
get gets set sets put make makes use uses using run runs call calls tool tools function functions thing things
given given value values new return returns data item items info information result results request
""".split())
_WORD = re.compile(r"[A-Za-z0-9]+")
_MARKER = re.compile(r"\[sim:[^\]]*\]")  # the sim's own markers are no words of the message
_HUMP = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")


def words(text: str) -> set[str]:
    """The meaningful words of a name, a description or a message: split at anything not a letter
    or digit and at camelCase humps, lower-cased, stop words and short words left out, plurals
    folded to their singular (cities -> city, boxes -> box, headlines -> headline)."""
    out = set()
    for chunk in _WORD.findall(text):
        for part in _HUMP.findall(chunk):
            word = part.lower()
            if len(word) >= MIN_LETTERS and word not in STOP_WORDS and not word.isdigit():
                out.add(_singular(word))
    return out


def _same(said: str, named: str) -> bool:
    """One word, or one a prefix of the other of at least four letters (look / lookup, time / timezone)."""
    short, long = sorted((said, named), key=len)
    return short == long or (len(short) >= 4 and long.startswith(short))


def _singular(word: str) -> str:
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith("es") and word[:-2].endswith(("s", "x", "z", "ch", "sh")):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def mentioned_function(message: str, functions: dict[str, str | None]) -> str | None:
    """The function (name -> description, in the request's order) the message mentions most, or None."""
    said = words(_MARKER.sub(" ", message))
    if not said:
        return None
    best, score = None, 0
    for name, description in functions.items():
        named = words(name) | words(description or "")
        hits = sum(any(_same(w, n) for n in named) for w in said)
        if hits > score:
            best, score = name, hits
    return best
