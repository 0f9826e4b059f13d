"""Text to Module: lark's LALR parser with inline callbacks that build the graphs directly.

No parse tree is built: each grammar rule's callback turns its tokens into IR values as the
parser reduces it, and `func` assembles the function's graph from the ops in source order,
resolving operands (which is where undefined, redefined and use-before-definition values are
caught). Positions come from the tokens (cheaper than `propagate_positions`); every error is a
`DiagnosticError` located at the offending token. The parser is built once per process, from a
lark grammar cache on disk.
"""

from __future__ import annotations

import gc
import math
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

# lark imports the third-party `regex` module when it is installed (15 ms, a tenth of `mplower
# opt`'s start-up) and uses it only for grammars built with regex=True, which ours is not: lark
# is imported with `regex` hidden, and the name is given back for anyone else who imports it.
_hidden = "regex" not in sys.modules
if _hidden:
    sys.modules["regex"] = None  # type: ignore[assignment]  (makes `import regex` fail)
try:
    from lark import Lark, Token
finally:
    if _hidden:
        del sys.modules["regex"]
from lark.exceptions import UnexpectedEOF, UnexpectedInput, UnexpectedToken
from lark.lexer import Lexer

from mplower.ir.attr_parser import AttributeBuilder, _short, _unquote
from mplower.ir.diagnostics import LINE_BREAK, Diagnostic, DiagnosticError, Location
from mplower.ir.graph import RETURN, Function, Module
from mplower.ir.types import (
    ATTRIBUTE_SCALAR_TYPES,
    UNIT,
    SymbolRef,
    TensorType,
    TypeAttr,
)

SPLIT_MARKER = re.compile(r"^// -----.*$", re.MULTILINE)

_GRAMMAR = Path(__file__).with_name("grammar.lark")
_MAX_RESULTS = 2 ** 32 - 1  # results of one op, as MLIR's unsigned count

# Readable names for lark's terminals in "expected ..." messages.
_TERMINAL_NAMES = {
    "VALUE_ID": "a value (%name)", "SYMBOL": "a symbol (@name)", "BARE_ID": "an identifier",
    "TENSOR_TYPE": "a tensor type", "INT": "an integer", "FLOAT": "a float",
    "STRING": "a string", "LPAR": "'('", "RPAR": "')'", "LBRACE": "'{'", "RBRACE": "'}'",
    "LSQB": "'['", "RSQB": "']'", "COMMA": "','", "COLON": "':'", "EQUAL": "'='",
    "LESSTHAN": "'<'", "MORETHAN": "'>'", "_ARROW": "'->'", "FUNC": "'func.func'",
    "RETURN": "'return'", "FUNC_RETURN": "'func.return'", "MODULE": "'module'",
    "TRUE": "'true'", "FALSE": "'false'", "DENSE": "'dense'", "ATTRIBUTES": "'attributes'",
    "SIMPLE_OP": "an operation",
    "$END": "end of file",
}


class _Names(tuple):
    """Operand names from a SIMPLE_OP token, which locates them if one is wrong."""

    def __new__(cls, names: list[str], tok: Token, at: int):
        self = super().__new__(cls, names)
        self.tok, self.at = tok, at
        return self


def _operand_token(operands: tuple, i: int) -> Token:
    if isinstance(operands, _Names):
        m = list(_VALUE_RE.finditer(operands.tok.value, operands.at))[i]
        return _sub(operands.tok, m.group(), m.start(), "VALUE_ID")
    return operands[i]


# ---- the lexer ----------------------------------------------------------------------------
_ID = r"[A-Za-z0-9_$.\-]+"
_TT = r"tensor<[^<>\n]*>"
# Whitespace is matched possessively (`\s*+`) wherever what follows cannot start with a space:
# a failed match then gives no run of spaces back to try it split between two `\s*`, which
# made a line with a long run of spaces cost time quadratic in its length.
_TYPES = rf"\(\s*+(?:{_TT}(?:\s*+,\s*+{_TT})*)?\s*+\)"
_NUM = r"[-+]?(?:0x[0-9a-fA-F]+|[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)"
# Unrolled (no repeated alternation) so that a long string costs no regex backtracking state.
_STR = r'"[^"\\\n]*(?:\\[^\n][^"\\\n]*)*"'
_BARE = r"[A-Za-z_][A-Za-z0-9_$.]*"
# A bare identifier the general lexer reads as BARE_ID rather than as a keyword; where the
# grammar wants an identifier, a keyword must leave the line to the general rules.
_NAME = (r"(?!(?:module|func\.func|func\.return|return|true|false|dense|attributes)"
         rf"(?![A-Za-z0-9_$.])){_BARE}")
_SIMPLE_VALUE = rf"(?:{_STR}|{_NUM}(?:\s*+:\s*+{_NAME})?|@{_BARE}|true|false|{_NAME})"
# A body `{ return }` must not read as a dictionary with a unit attribute named `return`.
_SIMPLE_ENTRY = rf"(?!(?:func\.)?return\b)(?:{_BARE}|{_STR})(?:\s*+=\s*+{_SIMPLE_VALUE})?"

_VAL = rf"%{_ID}(?:#[0-9]+)?"
_VALS = rf"{_VAL}(?:\s*+,\s*+{_VAL})*"
_FUNCTYPE = rf"{_TYPES}\s*+->\s*+(?:{_TT}|{_TYPES})"
_SIMPLE_ATTRS = rf"\{{\s*+{_SIMPLE_ENTRY}(?:\s*+,\s*+{_SIMPLE_ENTRY})*\s*+\}}"
# One operation on one line with scalar attributes, custom or generic form (see grammar.lark).
_SIMPLE_OP = (rf"(?P<res>%{_ID})(?::(?P<count>[0-9]+))?\s*+=\s*+"
              rf"(?:(?P<gname>{_STR})\((?P<gops>\s*+(?:{_VALS})?\s*+)\)"
              rf"|(?P<cname>{_NAME})(?P<cops>\s++{_VALS})?)"
              rf"\s*+(?P<attrs>{_SIMPLE_ATTRS})?\s*+:\s*+(?P<ftype>{_FUNCTYPE})[ \t]*+(?=\n|//|$)")

_TOKENS = [  # (name, pattern): tried in this order at each position
    ("SIMPLE_OP", _SIMPLE_OP),
    ("TENSOR_TYPE", _TT),
    ("VALUE_ID", _VAL),
    ("SYMBOL", r'@(?:[A-Za-z_$.][A-Za-z0-9_$.\-]*|"[^"\n]*")'),
    ("FLOAT", r"[-+]?[0-9]+(?:\.[0-9]*(?:[eE][-+]?[0-9]+)?|[eE][-+]?[0-9]+)"),
    ("INT", r"[-+]?(?:0x[0-9a-fA-F]+|[0-9]+)"),
    ("STRING", _STR),
    ("BARE_ID", _BARE),
    ("_ARROW", r"->"),
    ("PUNCT", r"[(){}\[\],:=<>]"),
]
_PUNCT = {"(": "LPAR", ")": "RPAR", "{": "LBRACE", "}": "RBRACE", "[": "LSQB", "]": "RSQB",
          ",": "COMMA", ":": "COLON", "=": "EQUAL", "<": "LESSTHAN", ">": "MORETHAN"}
_KEYWORDS = {"module": "MODULE", "func.func": "FUNC", "return": "RETURN",
             "func.return": "FUNC_RETURN", "true": "TRUE", "false": "FALSE", "dense": "DENSE",
             "attributes": "ATTRIBUTES"}
# Whitespace and comments are skipped possessively: backtracking into a comment would let a
# token match inside it.
_SPACE = r"(?:[ \t\f\r\n]++|//[^\n]*+)*+"
_MASTER = re.compile(_SPACE + "(?:" + "|".join(f"(?P<{n}>{p})" for n, p in _TOKENS) + ")")
_SKIP = re.compile(_SPACE)


class _IRLexer(Lexer):
    """One regex over the whole input: whitespace, comments and the next token in one match."""

    def __init__(self, conf: Any):
        pass

    def lex(self, text: str, *_: Any):
        end = len(text)
        pos, line, line_start = 0, 1 + _BUILDER.line_offset, 0
        match = _MASTER.match
        count = text.count
        rfind = text.rfind
        while True:
            m = match(text, pos)
            if m is None:
                pos = _SKIP.match(text, pos).end()
                if pos >= end:
                    return
                line = count("\n", 0, pos) + 1 + _BUILDER.line_offset
                line_start = rfind("\n", 0, pos) + 1
                raise _bad_character(text, pos, line, pos - line_start + 1)
            kind = m.lastgroup
            start = m.start(kind)
            nl = count("\n", pos, start)
            if nl:
                line += nl
                line_start = rfind("\n", pos, start) + 1
            value = m.group(kind)
            if kind == "PUNCT":
                kind = _PUNCT[value]
            elif kind == "BARE_ID":
                kind = _KEYWORDS.get(value, "BARE_ID")
            yield Token(kind, value, start, line, start - line_start + 1)
            pos = m.end()
            if "\n" in value:
                line += value.count("\n")
                line_start = start + value.rfind("\n") + 1


def _bad_character(text: str, pos: int, line: int, col: int) -> DiagnosticError:
    ch = text[pos]
    if ch == '"':
        msg = "unterminated string"
    elif ch == "%":
        msg = "malformed value name"
    elif ch == "@":
        msg = "malformed symbol name"
    else:
        msg = f"unexpected character {ch!r}"
    return DiagnosticError.at(Location(_BUILDER.file, line, col), msg)


_TT_RE = re.compile(_TT)
_VALUE_RE = re.compile(_VAL)
_SIMPLE_OP_RE = re.compile(_SIMPLE_OP)
_FLOAT_RE = re.compile(r"[-+]?[0-9]+(?:\.[0-9]*(?:[eE][-+]?[0-9]+)?|[eE][-+]?[0-9]+)")
_ENTRY_RE = re.compile(rf"(?P<key>{_BARE}|{_STR})(?:\s*+=\s*+(?P<value>{_STR}|(?P<num>{_NUM})"
                       rf"(?:\s*+:\s*+(?P<vtype>{_BARE}))?|@{_BARE}|{_BARE}))?")


def _sub(tok: Token, text: str, offset: int, kind: str) -> Token:
    """A token for `text` found `offset` characters into `tok` (for exact diagnostics)."""
    head = tok.value[:offset]
    nl = head.count("\n")
    col = offset - head.rfind("\n") if nl else tok.column + offset
    return Token(kind, text, tok.start_pos + offset, tok.line + nl, col)


def _loc(tok: Token, file: str) -> Location:
    return Location(file, tok.line, tok.column)


class _Builder(AttributeBuilder):
    """Grammar callbacks, one per rule or alias, each taking that rule's children in order."""

    def __init__(self, file: str):
        self.file = file
        self.source = ""  # the text being parsed, to locate a bad element of a dense literal
        self.line_offset = 0  # lines before the text (a chunk of a --split-input-file file)
        self.type_cache: dict[str, TensorType] = {}
        self.functype_cache: dict[str, tuple[list, list]] = {}

    # ---- types and attributes: attr_parser.AttributeBuilder; here what needs the source ---
    def _element_token(self, dense: Token, index: int) -> Token:
        """The token of element `index` of the dense literal starting at `dense`.

        Found again in the source only when an element is wrong: elements reach the dense
        rule as values (arrays are built before it is known that they are a dense body), and
        keeping a token per element would cost every literal for the sake of a bad one.
        """
        src, pos, n = self.source, dense.start_pos, -1
        while (m := _MASTER.match(src, pos)) is not None:
            kind = m.lastgroup
            if kind in ("INT", "FLOAT") or (kind == "BARE_ID" and m.group(kind) in ("true",
                                                                                  "false")):
                n += 1
                if n == index:
                    start = m.start(kind)
                    line = dense.line + src.count("\n", dense.start_pos, start)
                    col = start - src.rfind("\n", 0, start)
                    return Token(kind, m.group(kind), start, line, col)
            pos = m.end()
        return dense  # the literal lexed before, so not reached; the literal is the fallback

    # ---- ops -----------------------------------------------------------------------------
    def operands(self, *toks: Token) -> tuple[Token, ...]:
        return toks

    def result_def(self, tok: Token, count: Token | None) -> tuple[Token, int]:
        if "#" in tok.value:
            base = tok.value.split("#")[0]
            raise self.error(tok, f"'{tok.value}' names one result of an op and cannot be "
                                  f"defined; write '{base}:N = ...' for N results")
        return tok, self._result_count(tok, count.value if count is not None else None)

    def _result_count(self, tok: Token, text: str | None) -> int:
        n = 1
        if text is not None:
            if len(text) > len(str(_MAX_RESULTS)) or int(text) > _MAX_RESULTS:
                raise self.error(tok, f"result count {_short(text)} is too large "
                                      f"(at most {_MAX_RESULTS})")
            n = int(text)
        if n < 1:
            raise self.error(tok, "result count must be positive")
        return n

    def functype(self, ins: list | None, outs: list) -> tuple[list, list]:
        return ins or [], outs

    def _simple_op(self, tok: Token) -> tuple:
        m = _SIMPLE_OP_RE.match(tok.value)
        res, count, gname, gops, cname, cops, attrs, ftype = m.group(
            "res", "count", "gname", "gops", "cname", "cops", "attrs", "ftype")
        rtok = _sub(tok, res, 0, "VALUE_ID")
        n = self._result_count(rtok, count)
        if gname is not None:
            name_tok = _sub(tok, gname, m.start("gname"), "STRING")
            operands = _Names(_VALUE_RE.findall(gops), tok, m.start("gops"))
        else:
            name_tok = _sub(tok, cname, m.start("cname"), "BARE_ID")
            operands = (_Names(_VALUE_RE.findall(cops), tok, m.start("cops"))
                        if cops is not None else ())
        attr_dict = (self._simple_attrs(attrs, tok, m.start("attrs"))
                     if attrs is not None else {})
        types = self.functype_cache.get(ftype)
        if types is None:
            types = self._functype_text(tok, m.start("ftype"), ftype)
        # The generic name last: the grammar decodes it when the whole op is reduced.
        name = (cname if gname is None else
                _unquote(name_tok, self) if "\\" in gname else gname[1:-1])
        return ((rtok, n), name_tok, name, operands, attr_dict, types)

    def _functype_text(self, tok: Token, at: int, text: str) -> tuple[list, list]:
        arrow = text.index("->")
        ins = [self.type(_sub(tok, t.group(), at + t.start(), "TENSOR_TYPE"))
               for t in _TT_RE.finditer(text, 0, arrow)]
        outs = [self.type(_sub(tok, t.group(), at + t.start(), "TENSOR_TYPE"))
                for t in _TT_RE.finditer(text, arrow)]
        self.functype_cache[text] = (ins, outs)
        return ins, outs

    def _simple_attrs(self, text: str, tok: Token, at: int) -> dict:
        # Values are decoded from the text; a sub-token (for a located error) is made only when
        # something is wrong, which keeps the common case cheap. Errors come in the grammar's
        # order: the first bad value, else the first bad or repeated name.
        out: dict[str, Any] = {}
        name_error: DiagnosticError | None = None
        for m in _ENTRY_RE.finditer(text, 1):
            key, value = m.group("key", "value")
            if value is None:
                v: Any = UNIT
            elif (vtype := m.group("vtype")) is not None:
                num = m.group("num")
                if vtype not in ATTRIBUTE_SCALAR_TYPES:
                    self.type(_sub(tok, vtype, at + m.start("vtype"), "BARE_ID"))  # raises
                kind = "FLOAT" if _FLOAT_RE.fullmatch(num) else "INT"
                num_tok = _sub(tok, num, at + m.start("num"), kind)
                v = (self.typed_float_attr if kind == "FLOAT" else
                     self.typed_int_attr)(num_tok, vtype)
            elif (first := value[0]) == '"':
                v = (_unquote(_sub(tok, value, at + m.start("value"), "STRING"), self)
                     if "\\" in value else value[1:-1])
            elif first == "@":
                v = SymbolRef(value[1:])
            elif value == "true" or value == "false":
                v = value == "true"
            elif _FLOAT_RE.fullmatch(value):
                v = float(value)
                if math.isinf(v):
                    self.float_attr(_sub(tok, value, at + m.start("value"), "FLOAT"))  # raises
            elif first.isdigit() or first in "+-":
                try:
                    v = int(value, 0) if "x" in value else int(value)
                except ValueError:  # past Python's limit on decimal digits
                    self._decimal(_sub(tok, value, at + m.start("value"), "INT"))  # raises
            elif value in ATTRIBUTE_SCALAR_TYPES:
                v = TypeAttr(value)
            else:
                self.type(_sub(tok, value, at + m.start("value"), "BARE_ID"))  # raises
            if name_error is not None:
                continue
            if key[0] == '"':
                try:
                    key = _unquote(_sub(tok, key, at + m.start("key"), "STRING"), self)
                except DiagnosticError as e:
                    name_error = e
                    continue
            if key in out:
                name_error = self.error(_sub(tok, key, at + m.start("key"), "BARE_ID"),
                                        f"duplicate attribute '{key}'")
                continue
            out[key] = v
        if name_error is not None:
            raise name_error
        return out

    def custom_op(self, rdef, name: Token, operands, attrs, ftype) -> tuple:
        return (rdef, name, name.value, operands or (), attrs or {}, ftype)

    def generic_op(self, rdef, name: Token, operands, attrs, ftype) -> tuple:
        return (rdef, name, _unquote(name, self), operands or (), attrs or {}, ftype)

    def return_op(self, tok: Token, operands, types) -> tuple:
        return (None, tok, RETURN, operands or (), {}, (types or [], []))

    def arg(self, tok: Token, t: Any) -> tuple[Token, Any]:
        return tok, t

    def args(self, *a: tuple) -> list:
        return list(a)

    def func(self, kw: Token, sym: Token, args, results, _attributes, attrs, *rest) -> Function:
        ops, rbrace = rest[:-1], rest[-1]
        name = sym.value[1:].strip('"')
        f = Function(name, _loc(kw, self.file))
        f.attrs = dict(attrs or {})
        f.result_types = [self._tensor(t, sym) for t in (results or [])]
        values: dict[str, tuple[int, int]] = {}
        nodes = f.graph.nodes
        for tok, t in args or ():
            if tok.value in values:
                raise self.error(tok, f"redefinition of value '{tok.value}'")
            node = f.add_arg(tok.value[1:], self._tensor(t, tok), _loc(tok, self.file))
            values[tok.value] = (node, 0)
        seen_return = False
        simple_op = self._simple_op
        for item in ops:
            if type(item) is Token:  # a SIMPLE_OP line, decoded here rather than by a rule
                item = simple_op(item)
            rdef, name_tok, op_name, operand_toks, op_attrs, (in_types, out_types) = item
            if seen_return:
                raise self.error(name_tok, "operation after the function's return")
            if op_name in ("func.return", RETURN):
                op_name, seen_return = RETURN, True
                out_types = []
            operand_values = []
            for i, ot in enumerate(operand_toks):
                v = values.get(ot)
                if v is None:
                    v = self._result_ref(_operand_token(operand_toks, i), values, ops)
                operand_values.append(v)
            if len(in_types) != len(operand_values):
                raise self.error(name_tok, f"'{op_name}' has {len(operand_values)} operands but its "
                                           f"type lists {len(in_types)}")
            in_tensors = [self._tensor(t, name_tok) for t in in_types]
            for i, (v, t) in enumerate(zip(operand_values, in_tensors)):
                actual = nodes[v[0]]["types"][v[1]]
                if actual != t:
                    raise self.error(_operand_token(operand_toks, i),
                                     f"operand #{i} '{operand_toks[i]}' has type {actual} but "
                                     f"the op expects {t}")
            out_tensors = [self._tensor(t, name_tok) for t in out_types]
            result_name = ""
            if rdef is not None:
                rtok, count = rdef
                if count != len(out_tensors):
                    raise self.error(rtok, f"'{rtok.value}:{count}' defines {count} results but "
                                           f"the op's type has {len(out_tensors)}")
                if rtok.value in values or f"{rtok.value}#0" in values:
                    raise self.error(rtok, f"redefinition of value '{rtok.value}'")
                result_name = rtok.value[1:]
            elif out_tensors and op_name != RETURN:
                raise self.error(name_tok, f"'{op_name}' has results but no name to bind them")
            loc = _loc(rdef[0] if rdef is not None else name_tok, self.file)
            node = f.append_op(op_name, operand_values, op_attrs, out_tensors, result_name, loc)
            if rdef is not None:
                if len(out_tensors) == 1:
                    values[rdef[0].value] = (node, 0)
                else:
                    for i in range(len(out_tensors)):
                        values[f"{rdef[0].value}#{i}"] = (node, i)
        if not seen_return:
            raise self.error(rbrace, f"function @{name} does not end with a return")
        return f

    def _result_ref(self, tok: Token, values: dict, ops: tuple) -> tuple[int, int]:
        base = tok.value.split("#")[0]
        if "#" in tok.value and base in values:
            raise self.error(tok, f"'{base}' has a single result; use it without '#'")
        n = 0
        while f"{base}#{n}" in values:
            n += 1
        if n:  # an earlier op with n results
            raise self.error(tok, f"use of undefined value '{tok.value}': '{base}' has {n} "
                                  f"results, '{base}#0' to '{base}#{n - 1}'")
        if any(_defined_name(item) == base for item in ops):
            raise self.error(tok, f"use of value '{tok.value}' before its definition")
        raise self.error(tok, f"use of undefined value '{tok.value}'")

    def _tensor(self, t: Any, tok: Token) -> TensorType:
        if not isinstance(t, TensorType):
            raise self.error(tok, f"expected a tensor type, got '{t}'")
        return t

    def module(self, kw: Token, sym: Token | None, _attributes, attrs, *rest) -> Module:
        funcs = rest[:-1]
        m = Module(name=sym.value[1:].strip('"') if sym is not None else None,
                   attrs=dict(attrs or {}), loc=_loc(kw, self.file),
                   attr_locs={k: _loc(t, self.file) for k, t in (attrs.keys_at if attrs
                                                                  else {}).items()})
        for f in funcs:
            _add_function(m, f, self)
        return m

    def start(self, *items: Any) -> Module:
        modules = [i for i in items if isinstance(i, Module)]
        funcs = [i for i in items if isinstance(i, Function)]
        if modules and (funcs or len(modules) > 1):
            loc = funcs[0].loc if funcs else modules[1].loc
            raise DiagnosticError.at(loc, "a file holds either one module or bare functions")
        # A file of bare functions (or none) is a module that starts where the file does.
        m = modules[0] if modules else Module(
            loc=funcs[0].loc if funcs else Location(self.file, 1 + self.line_offset, 1))
        for f in funcs:
            _add_function(m, f, self)
        return m


def _defined_name(item: Token | tuple) -> str | None:
    """The result name an op of a function body defines (`%0`), or None."""
    if type(item) is Token:
        return _VALUE_RE.match(item.value).group()
    return item[0][0].value if item[0] is not None else None


def _add_function(m: Module, f: Function, b: _Builder) -> None:
    if f.name in m.functions:
        raise DiagnosticError.at(f.loc, f"redefinition of function @{f.name}")
    m.functions[f.name] = f


_BUILDER = _Builder("<stdin>")


class _Callbacks:
    """What lark calls on each reduction: the builder's methods, taking the children list."""

    def __init__(self, builder: _Builder):
        for name in dir(builder):
            if not name.startswith("_"):
                method = getattr(builder, name)
                if callable(method):
                    setattr(self, name, lambda children, m=method: m(*children))


@lru_cache(maxsize=1)
def _lark() -> Lark:
    # The builder is bound once; parse() points it at the current file before each run.
    grammar = _GRAMMAR.read_text()
    return Lark(grammar, parser="lalr", lexer=_IRLexer, cache=_cache_file(grammar),
                maybe_placeholders=True, transformer=_Callbacks(_BUILDER))


def _cache_file(grammar: str) -> str | bool:
    """Where lark keeps its parse tables between processes (60 ms to build, 4 ms to load).

    Lark's cache is a pickle, so it lives in the user's own cache folder (as trusted as the
    user's files), never in a shared temporary folder; named by the grammar's and lark's
    versions, so a changed grammar never loads stale tables. False (no cache) if unwritable.
    """
    import hashlib
    import logging
    import os

    import lark

    key = hashlib.sha256(f"{lark.__version__}\0{grammar}".encode()).hexdigest()[:16]
    # A cache file another process is writing fails to load; lark then rebuilds the tables
    # and logs the failure with a traceback, which must not reach the user.
    logging.getLogger("lark").setLevel(logging.CRITICAL)
    try:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mplower"
        base.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError):  # no home folder, or not writable: build the tables
        return False
    return str(base / f"grammar-{key}.lark")


def parse(text: str, file: str = "<stdin>", line_offset: int = 0) -> Module:
    """Parse IR text into a Module; raises DiagnosticError at the first error.

    `line_offset`: lines of the file before `text` (a chunk of a split file), so that
    locations are the file's.
    """
    lark = _lark()
    src = normalize_newlines(text)
    _BUILDER.file, _BUILDER.source, _BUILDER.line_offset = file, src, line_offset
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the parse allocates millions of objects and frees none of them
    try:
        module = lark.parse(src)
    except UnexpectedInput as e:
        raise _syntax_error(e, src, file, line_offset) from None
    except RecursionError:
        raise DiagnosticError.at(Location(file, 1 + line_offset, 1),
                                 "input nests too deeply") from None
    finally:
        _BUILDER.source = ""
        if gc_was_enabled:
            gc.enable()
    module.path = file
    return module


def normalize_newlines(text: str) -> str:
    """`text` with CR LF and lone CR line endings as LF: each is a line break (old Mac files
    are otherwise one line, a comment at the top hiding everything)."""
    return LINE_BREAK.sub("\n", text) if "\r" in text else text


def _syntax_error(e: UnexpectedInput, src: str, file: str, line_offset: int) -> DiagnosticError:
    line, col = getattr(e, "line", 0) or 0, getattr(e, "column", 0) or 0
    if isinstance(e, UnexpectedToken) and e.token.type != "$END":
        tok = e.token
        msg = f"unexpected {_describe(tok)}"
        expected = sorted({_TERMINAL_NAMES.get(t, t) for t in e.expected})
        if expected and len(expected) <= 6:
            msg += f"; expected {', '.join(expected)}"
            end = _end_of_last_token(src, tok.start_pos)
            if end is not None and "\n" in src[end:tok.start_pos]:
                # Something is missing at the end of a line: say so there, as MLIR does, not
                # at the next line's first token.
                line = tok.line - src.count("\n", end, tok.start_pos)
                col = end - src.rfind("\n", 0, end)
                msg = (f"expected {', '.join(expected)}; found {_describe(tok)} on line "
                       f"{tok.line}")
    elif isinstance(e, UnexpectedToken | UnexpectedEOF):
        msg = "unexpected end of file"
        end = _end_of_last_token(src, len(src))
        end = 0 if end is None else end
        line = 1 + line_offset + src.count("\n", 0, end)
        col = end - src.rfind("\n", 0, end)
        if isinstance(e, UnexpectedToken):
            expected = sorted({_TERMINAL_NAMES.get(t, t) for t in e.expected})
            if expected and len(expected) <= 6:
                msg += f"; expected {', '.join(expected)}"
    else:  # the lexer reports bad characters itself
        msg = "syntax error"
    return DiagnosticError(Diagnostic(Location(file, line, col), msg))


def _end_of_last_token(src: str, pos: int) -> int | None:
    """Offset just past the last token that ends before `pos` (skipping blank lines and
    comments), or None when there is none. Each line is lexed on its own from its start, which
    is always a token boundary: tokens other than whole simple ops never span lines."""
    line_end = pos
    while line_end >= 0:
        line_start = src.rfind("\n", 0, line_end) + 1
        end, at = None, line_start
        while (m := _MASTER.match(src, at, line_end)) is not None and m.end() > at:
            end = at = m.end()
        if end is not None:
            return end
        line_end = line_start - 1
    return None


def _describe(tok: Token) -> str:
    text = tok.value if len(tok.value) <= 40 else tok.value[:37] + "..."
    if tok.type == "BARE_ID":
        return f"identifier '{text}'"
    return f"'{text}'"


def decode_source(data: bytes, file: str) -> str:
    """UTF-8 text of a file with its line breaks as LF, or a diagnostic pointing at the first
    invalid byte."""
    try:
        return normalize_newlines(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        # Columns count characters, as everywhere else; the bytes before the bad one are valid.
        head = normalize_newlines(data[:e.start].decode("utf-8"))
        line = head.count("\n") + 1
        col = len(head) - head.rfind("\n")
        err = DiagnosticError.at(Location(file, line, col),
                                 f"invalid UTF-8 byte 0x{data[e.start]:02x}")
        err.source = normalize_newlines(data.decode("utf-8", "replace"))
        raise err from None


def split_source(text: str) -> list[tuple[str, int]]:
    """`// -----` chunks of a file with the line offset of each (for --split-input-file)."""
    chunks, start, offset = [], 0, 0
    for m in SPLIT_MARKER.finditer(text):
        chunks.append((text[start:m.start()], offset))
        offset += text.count("\n", start, m.end())
        start = m.end()
    chunks.append((text[start:], offset))
    return chunks


def parse_file(path: str | Path) -> Module:
    data = Path(path).read_bytes()
    return parse(decode_source(data, str(path)), str(path))
