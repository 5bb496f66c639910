//! JSON output (OpenAI's `response_format`): `{"type": "json_object"}` holds the output to
//! one JSON object (RFC 8259), `{"type": "json_schema", ...}` to one object of a schema
//! (structured outputs), by masking, at every step, the tokens whose bytes cannot continue it.
//!
//! A [`Schema`] is compiled from a JSON Schema into a small arena of [`Node`]s; `json_object`
//! is the schema "any object". [`JsonState`] reads the output byte by byte: a pushdown
//! automaton whose stack holds one frame a value being read (an object with the properties
//! it has seen and the keys a partial key can still become, an array, a string, a number, a
//! literal, an enum's remaining candidates), at most [`MAX_DEPTH`] deep. It is `Copy`, so a
//! candidate token is tried on a copy ([`JsonState::accepts`]). [`mask`] runs that over the
//! vocabulary (in parallel: ~150k tokens of a few bytes each; a token whose first byte cannot
//! come next is dropped without a trial, a run of plain string bytes inside a string kept
//! without one) and leaves `-inf` on every token that cannot come next; the sampler then picks among the rest as it would anyway
//! (greedy, temperature, top-k/p, penalties), so the request samples from the model's
//! distribution restricted to valid continuations. Once the object is closed only an
//! end-of-sequence token may follow (whitespace where the request ignores EOS).
//!
//! Cost (`cargo run --release -p ferrite-engine --example json_mask_speed` on Qwen3's
//! tokenizer.json, 151,669 tokens, 2 threads of this development machine): 2.0–2.9 ms a step with the two shortcuts,
//! 4.9–6.8 ms with full trials only; the trials parallelise, so a 16-core host takes a
//! fraction of that. It is paid on the host for each JSON request's step.
//!
//! What a schema may say (anything else is refused when it is compiled, rather than ignored):
//! `type` (object, array, string, number, integer, boolean, null, or a list of them),
//! `properties`, `required`, `additionalProperties`, `items`, `enum`, `const`, `anyOf` /
//! `oneOf` whose alternatives start with different bytes (`Optional[X]`: X or null), `$ref`
//! into `$defs` / `definitions`, and the annotations `title`, `description`, `default`, `examples`,
//! `$schema`, `$id`, `format` (not enforced), `strict`. The root must be an object. An object
//! with `properties` takes exactly those keys (each at most once, the required ones before it
//! closes; extra keys are never produced, which every `additionalProperties` allows); one
//! without takes any keys with any values. Keys are written as the schema spells them (no
//! escapes); strings may hold any bytes but unescaped control characters (a multi-byte
//! character split over tokens is fine: bytes ≥ 0x80 are string content).

use std::collections::HashMap;

use anyhow::{bail, ensure, Context, Result};
use ferrite_tokenizer::Tokenizer;
use rayon::prelude::*;
use serde::Deserialize;

/// Deepest nesting of values (objects, arrays, and the scalar being read) in the output.
pub const MAX_DEPTH: usize = 24;
/// Most properties of one object, and most values of one enum (bit masks).
pub const MAX_CHOICES: usize = 64;

type NodeId = u16;

/// One schema node.
#[derive(Clone, Debug, PartialEq)]
pub enum Node {
    /// Any JSON value.
    Any,
    /// An object: with `props`, exactly those keys (`required` a bit mask over them);
    /// without, any keys with any values.
    Object {
        props: Vec<(Vec<u8>, NodeId)>,
        required: u64,
    },
    Array {
        items: NodeId,
    },
    String,
    Number {
        integer: bool,
    },
    Boolean,
    Null,
    /// One of these values, as JSON text (serde_json's compact form).
    Enum(Vec<Vec<u8>>),
    /// One of these alternatives, told apart by their first byte (`anyOf`, a list of
    /// types: `Optional[X]` is X or null): each with the set of bytes it can start with.
    Union(Vec<(NodeId, ByteSet)>),
}

/// A set of bytes.
pub type ByteSet = [u64; 4];

fn set_has(s: &ByteSet, b: u8) -> bool {
    s[(b >> 6) as usize] & (1 << (b & 63)) != 0
}

fn set_add(s: &mut ByteSet, b: u8) {
    s[(b >> 6) as usize] |= 1 << (b & 63);
}

/// A compiled schema: its nodes, the root first.
#[derive(Clone, Debug, PartialEq)]
pub struct Schema {
    nodes: Vec<Node>,
}

const ANY: NodeId = 1;

impl Schema {
    /// `json_object`: any object.
    pub fn any_object() -> Schema {
        Schema {
            nodes: vec![
                Node::Object {
                    props: vec![],
                    required: 0,
                },
                Node::Any,
            ],
        }
    }

    /// Compiles a JSON Schema (module doc says which keywords); an error names what is not
    /// supported.
    pub fn compile(schema: &serde_json::Value) -> Result<Schema> {
        let mut c = Compiler {
            nodes: vec![Node::Any, Node::Any],
            root: schema,
            refs: HashMap::new(),
        };
        let root = c.node(schema, "schema")?;
        ensure!(
            matches!(c.nodes[root as usize], Node::Object { .. }),
            "the schema's root must be an object"
        );
        // Root first: move it to slot 0 (every reference to it is `root`, now 0).
        c.nodes.swap(0, root as usize);
        let fix = |id: NodeId| match id {
            0 => root,
            x if x == root => 0,
            x => x,
        };
        for n in &mut c.nodes {
            match n {
                Node::Object { props, .. } => props.iter_mut().for_each(|p| p.1 = fix(p.1)),
                Node::Array { items } => *items = fix(*items),
                _ => {}
            }
        }
        Ok(Schema { nodes: c.nodes })
    }

    fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }
}

struct Compiler<'a> {
    nodes: Vec<Node>,
    root: &'a serde_json::Value,
    /// `$ref` targets already given a node (recursive schemas point back to it).
    refs: HashMap<String, NodeId>,
}

const ANNOTATIONS: [&str; 8] = [
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "format",
    "strict",
];

impl Compiler<'_> {
    fn push(&mut self, n: Node) -> Result<NodeId> {
        ensure!(
            self.nodes.len() < NodeId::MAX as usize,
            "the schema is too large"
        );
        self.nodes.push(n);
        Ok((self.nodes.len() - 1) as NodeId)
    }

    fn node(&mut self, s: &serde_json::Value, at: &str) -> Result<NodeId> {
        let obj = match s {
            serde_json::Value::Bool(true) => return Ok(ANY),
            serde_json::Value::Object(o) => o,
            _ => bail!("{at}: a schema must be an object"),
        };
        if let Some(r) = obj.get("$ref") {
            let r = r
                .as_str()
                .with_context(|| format!("{at}: $ref must be a string"))?;
            return self.reference(r, at);
        }
        for k in obj.keys() {
            let known = matches!(
                k.as_str(),
                "type"
                    | "properties"
                    | "required"
                    | "additionalProperties"
                    | "items"
                    | "enum"
                    | "const"
                    | "$defs"
                    | "definitions"
                    | "anyOf"
                    | "oneOf"
            ) || ANNOTATIONS.contains(&k.as_str());
            ensure!(known, "{at}: the schema keyword \"{k}\" is not supported");
        }
        if let Some(alts) = obj.get("anyOf").or_else(|| obj.get("oneOf")) {
            ensure!(
                !obj.contains_key("type")
                    && !obj.contains_key("enum")
                    && !obj.contains_key("properties"),
                "{at}: anyOf / oneOf beside type, enum or properties is not supported"
            );
            let alts = alts
                .as_array()
                .with_context(|| format!("{at}: anyOf must be an array"))?;
            let ids = alts
                .iter()
                .enumerate()
                .map(|(i, a)| self.node(a, &format!("{at}.anyOf[{i}]")))
                .collect::<Result<Vec<_>>>()?;
            return self.union(ids, at);
        }
        if let Some(c) = obj.get("const") {
            return self.push(Node::Enum(vec![serde_json::to_vec(c)?]));
        }
        if let Some(e) = obj.get("enum") {
            let e = e
                .as_array()
                .with_context(|| format!("{at}: enum must be an array"))?;
            ensure!(
                (1..=MAX_CHOICES).contains(&e.len()),
                "{at}: enum of {} values (1 to {MAX_CHOICES})",
                e.len()
            );
            let values = e.iter().map(serde_json::to_vec).collect::<Result<_, _>>()?;
            return self.push(Node::Enum(values));
        }
        let ty = match obj.get("type") {
            // Properties without a type: an object's.
            None if obj.contains_key("properties") || obj.contains_key("required") => "object",
            None => return Ok(ANY),
            Some(serde_json::Value::String(t)) => t.as_str(),
            Some(serde_json::Value::Array(types)) => {
                // A list of types: each one with the schema's other keywords.
                let mut ids = vec![];
                for t in types {
                    let mut one = obj.clone();
                    one.insert("type".into(), t.clone());
                    ids.push(self.node(&serde_json::Value::Object(one), at)?);
                }
                return self.union(ids, at);
            }
            Some(t) => bail!("{at}: type {t} is not supported"),
        };
        match ty {
            "object" => {
                let id = self.push(Node::Any)?;
                let mut props = vec![];
                let mut required = 0u64;
                if let Some(p) = obj.get("properties") {
                    let p = p
                        .as_object()
                        .with_context(|| format!("{at}: properties must be an object"))?;
                    ensure!(
                        p.len() <= MAX_CHOICES,
                        "{at}: {} properties (at most {MAX_CHOICES})",
                        p.len()
                    );
                    for (k, v) in p {
                        // A key the model writes between quotes, as it is spelled.
                        let key = serde_json::to_vec(k)?;
                        ensure!(
                            !k.is_empty() && key.len() == k.len() + 2,
                            "{at}: property name {k:?} needs escapes (not supported)"
                        );
                        let child = self.node(v, &format!("{at}.properties.{k}"))?;
                        props.push((key[1..key.len() - 1].to_vec(), child));
                    }
                }
                if let Some(r) = obj.get("required") {
                    let r = r
                        .as_array()
                        .with_context(|| format!("{at}: required must be an array"))?;
                    for name in r {
                        let name = name
                            .as_str()
                            .with_context(|| format!("{at}: required names are strings"))?;
                        let i = props
                            .iter()
                            .position(|(k, _)| k == name.as_bytes())
                            .with_context(|| {
                                format!("{at}: required property {name:?} is not in properties")
                            })?;
                        required |= 1 << i;
                    }
                }
                self.nodes[id as usize] = Node::Object { props, required };
                Ok(id)
            }
            "array" => {
                let id = self.push(Node::Any)?;
                let items = match obj.get("items") {
                    Some(i) => self.node(i, &format!("{at}.items"))?,
                    None => ANY,
                };
                self.nodes[id as usize] = Node::Array { items };
                Ok(id)
            }
            "string" => self.push(Node::String),
            "number" => self.push(Node::Number { integer: false }),
            "integer" => self.push(Node::Number { integer: true }),
            "boolean" => self.push(Node::Boolean),
            "null" => self.push(Node::Null),
            t => bail!("{at}: type \"{t}\" is not supported"),
        }
    }

    /// The bytes a value of node `id` can start with.
    fn first_bytes(&self, id: NodeId) -> ByteSet {
        let mut set = [0u64; 4];
        let mut add = |bytes: &[u8]| bytes.iter().for_each(|&b| set_add(&mut set, b));
        match &self.nodes[id as usize] {
            Node::Any => return [u64::MAX; 4],
            Node::Object { .. } => add(b"{"),
            Node::Array { .. } => add(b"["),
            Node::String => add(b"\""),
            Node::Number { .. } => add(b"-0123456789"),
            Node::Boolean => add(b"tf"),
            Node::Null => add(b"n"),
            Node::Enum(values) => values.iter().for_each(|v| add(&v[..1])),
            Node::Union(alts) => {
                for (_, s) in alts {
                    for (a, b) in set.iter_mut().zip(s) {
                        *a |= b;
                    }
                }
            }
        }
        set
    }

    /// A union of `ids`, refused where two alternatives can start with the same byte (the
    /// reader could not tell which one it is reading).
    fn union(&mut self, ids: Vec<NodeId>, at: &str) -> Result<NodeId> {
        ensure!(
            (1..=MAX_CHOICES).contains(&ids.len()),
            "{at}: {} alternatives (1 to {MAX_CHOICES})",
            ids.len()
        );
        let alts: Vec<(NodeId, ByteSet)> = ids.iter().map(|&i| (i, self.first_bytes(i))).collect();
        for (i, (_, a)) in alts.iter().enumerate() {
            for (_, b) in &alts[..i] {
                ensure!(
                    a.iter().zip(b).all(|(x, y)| x & y == 0),
                    "{at}: the alternatives of anyOf / a type list must start differently \
                     (e.g. an object or null; not two objects or two strings)"
                );
            }
        }
        self.push(Node::Union(alts))
    }

    /// `#/$defs/Name` or `#/definitions/Name`, compiled once.
    fn reference(&mut self, r: &str, at: &str) -> Result<NodeId> {
        if let Some(&id) = self.refs.get(r) {
            return Ok(id);
        }
        let target = r
            .strip_prefix("#/")
            .map(|p| p.split('/').collect::<Vec<_>>())
            .filter(|p| p.len() == 2 && (p[0] == "$defs" || p[0] == "definitions"))
            .and_then(|p| self.root.get(p[0])?.get(p[1]))
            .with_context(|| format!("{at}: $ref {r:?} (only #/$defs/… and #/definitions/…)"))?;
        // A placeholder first, so that a recursive reference finds it.
        let id = self.push(Node::Any)?;
        self.refs.insert(r.to_string(), id);
        let body = self.node(target, r)?;
        self.nodes[id as usize] = self.nodes[body as usize].clone();
        Ok(id)
    }
}

/// Where a number is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

/// What a frame expects next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Before the root object: whitespace or `{`.
    Root,
    /// The root object is closed: whitespace only.
    Done,
    /// After `{`: a key or `}`.
    ObjOpen,
    /// After `,` in an object: a key.
    ObjKey,
    /// Inside a key of listed properties (`cand`: those it can still become; `pos` bytes in).
    Key,
    /// After a key: `:`.
    Colon,
    /// After `:`: the property's value.
    ObjValue,
    /// After a property's value: `,` or `}`.
    ObjAfter,
    /// After `[`: a value or `]`.
    ArrOpen,
    /// After `,` in an array: a value.
    ArrValue,
    /// After an item: `,` or `]`.
    ArrAfter,
    /// Inside a string: a string value (its own frame), or with `key` a free key (an object
    /// without listed properties, in the object's frame: its close quote expects `:`).
    Str {
        key: bool,
    },
    Esc {
        key: bool,
    },
    Hex {
        key: bool,
        left: u8,
    },
    Num(Num),
    /// Inside `true` (0), `false` (1) or `null` (2), `pos` bytes matched.
    Lit(u8),
    /// Inside an enum value (`cand`: the values it can still be; `pos` bytes in).
    Enum,
}

/// One value being read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Frame {
    node: NodeId,
    mode: Mode,
    /// Objects: properties seen.
    seen: u64,
    /// Keys or enum values still possible.
    cand: u64,
    pos: u16,
    /// Objects: the property whose value is being read.
    prop: u8,
    /// Numbers: integers only.
    integer: bool,
}

impl Frame {
    fn new(node: NodeId, mode: Mode) -> Frame {
        Frame {
            node,
            mode,
            seen: 0,
            cand: 0,
            pos: 0,
            prop: 0,
            integer: false,
        }
    }
}

const LITERALS: [&[u8]; 3] = [b"true", b"false", b"null"];

/// The reader of a JSON output against a [`Schema`] (module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JsonState {
    stack: [Frame; MAX_DEPTH],
    depth: u8,
}

impl Default for JsonState {
    fn default() -> Self {
        let mut stack = [Frame::new(0, Mode::Root); MAX_DEPTH];
        stack[0] = Frame::new(0, Mode::Root);
        JsonState { stack, depth: 1 }
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

fn bit(i: usize) -> u64 {
    1u64 << i
}

/// Mask of the first `n` choices.
fn all(n: usize) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        bit(n) - 1
    }
}

impl JsonState {
    /// Whether the root object is complete.
    pub fn complete(&self) -> bool {
        self.depth == 1 && self.stack[0].mode == Mode::Done
    }

    /// Whether the next bytes are read as string content (a string value or a free key, not
    /// in an escape): any run of bytes without a quote, a backslash or a control character
    /// is accepted there.
    pub fn in_string(&self) -> bool {
        let f = &self.stack[self.depth as usize - 1];
        matches!(f.mode, Mode::Str { .. })
    }

    /// Whether `bytes` can follow what was read so far (the state unchanged).
    pub fn accepts(&self, s: &Schema, bytes: &[u8]) -> bool {
        let mut st = *self;
        bytes.iter().all(|&b| st.feed(s, b))
    }

    fn top(&mut self) -> &mut Frame {
        &mut self.stack[self.depth as usize - 1]
    }

    fn push(&mut self, f: Frame) -> bool {
        if self.depth as usize == MAX_DEPTH {
            return false;
        }
        self.stack[self.depth as usize] = f;
        self.depth += 1;
        true
    }

    /// The value on top is complete: pop it and move its parent on.
    fn value_done(&mut self) {
        self.depth -= 1;
        let p = self.top();
        p.mode = match p.mode {
            Mode::Root => Mode::Done,
            Mode::ObjValue => {
                p.seen |= bit(p.prop as usize);
                Mode::ObjAfter
            }
            Mode::ArrOpen | Mode::ArrValue => Mode::ArrAfter,
            m => m,
        };
    }

    /// Starts a value of `node` with byte `b` (pushing its frame).
    fn start(&mut self, s: &Schema, node: NodeId, b: u8) -> bool {
        let kind = s.node(node);
        let f = |mode| Frame::new(node, mode);
        match (kind, b) {
            (Node::Any | Node::Object { .. }, b'{') => self.push(f(Mode::ObjOpen)),
            (Node::Any | Node::Array { .. }, b'[') => self.push(f(Mode::ArrOpen)),
            (Node::Any | Node::String, b'"') => self.push(f(Mode::Str { key: false })),
            (Node::Any | Node::Number { .. }, b'-' | b'0'..=b'9') => {
                let mut fr = f(Mode::Num(match b {
                    b'-' => Num::Minus,
                    b'0' => Num::Zero,
                    _ => Num::Int,
                }));
                fr.integer = matches!(kind, Node::Number { integer: true });
                self.push(fr)
            }
            (Node::Any | Node::Boolean, b't') => self.push(lit(node, 0)),
            (Node::Any | Node::Boolean, b'f') => self.push(lit(node, 1)),
            (Node::Any | Node::Null, b'n') => self.push(lit(node, 2)),
            (Node::Union(alts), _) => match alts.iter().find(|(_, set)| set_has(set, b)) {
                Some(&(alt, _)) => self.start(s, alt, b),
                None => false,
            },
            (Node::Enum(values), _) => {
                let mut fr = f(Mode::Enum);
                fr.cand = values
                    .iter()
                    .enumerate()
                    .filter(|(_, v)| v.first() == Some(&b))
                    .fold(0, |m, (i, _)| m | bit(i));
                fr.pos = 1;
                fr.cand != 0 && self.push(fr)
            }
            _ => false,
        }
    }

    /// Feeds one byte; `false` (the state then undefined) where it cannot continue the
    /// output.
    pub fn feed(&mut self, s: &Schema, b: u8) -> bool {
        let f = *self.top();
        let structural = matches!(
            f.mode,
            Mode::Root
                | Mode::Done
                | Mode::ObjOpen
                | Mode::ObjKey
                | Mode::Colon
                | Mode::ObjValue
                | Mode::ObjAfter
                | Mode::ArrOpen
                | Mode::ArrValue
                | Mode::ArrAfter
        );
        if structural && is_ws(b) {
            return true;
        }
        match f.mode {
            Mode::Root => b == b'{' && self.start(s, 0, b),
            Mode::Done => false,
            Mode::ObjOpen | Mode::ObjKey => {
                let Node::Object { props, required } = s.node_of_object(f.node) else {
                    return false;
                };
                if f.mode == Mode::ObjOpen && b == b'}' {
                    return f.seen & *required == *required && {
                        self.value_done();
                        true
                    };
                }
                if b != b'"' {
                    return false;
                }
                let t = self.top();
                if props.is_empty() {
                    t.mode = Mode::Str { key: true };
                } else {
                    t.mode = Mode::Key;
                    t.cand = all(props.len()) & !f.seen;
                    t.pos = 0;
                }
                t.cand != 0 || props.is_empty()
            }
            Mode::Key => {
                let Node::Object { props, .. } = s.node_of_object(f.node) else {
                    return false;
                };
                let pos = f.pos as usize;
                let t = self.top();
                if b == b'"' {
                    // The key ends: exactly one listed key is this long.
                    let done =
                        (0..props.len()).find(|&i| f.cand & bit(i) != 0 && props[i].0.len() == pos);
                    return match done {
                        Some(i) => {
                            t.prop = i as u8;
                            t.mode = Mode::Colon;
                            true
                        }
                        None => false,
                    };
                }
                t.cand = (0..props.len())
                    .filter(|&i| f.cand & bit(i) != 0 && props[i].0.get(pos) == Some(&b))
                    .fold(0, |m, i| m | bit(i));
                t.pos += 1;
                t.cand != 0
            }
            Mode::Colon => {
                self.top().mode = Mode::ObjValue;
                b == b':'
            }
            Mode::ObjValue => {
                let child = match s.node_of_object(f.node) {
                    Node::Object { props, .. } if !props.is_empty() => props[f.prop as usize].1,
                    _ => ANY,
                };
                self.start(s, child, b)
            }
            Mode::ObjAfter => {
                let Node::Object { props, required } = s.node_of_object(f.node) else {
                    return false;
                };
                match b {
                    b',' => {
                        // Another key must be possible.
                        let more = props.is_empty() || all(props.len()) & !f.seen != 0;
                        self.top().mode = Mode::ObjKey;
                        more
                    }
                    b'}' => {
                        let free = props.is_empty();
                        (free || f.seen & *required == *required) && {
                            self.value_done();
                            true
                        }
                    }
                    _ => false,
                }
            }
            Mode::ArrOpen if b == b']' => {
                self.value_done();
                true
            }
            Mode::ArrOpen | Mode::ArrValue => {
                let items = match s.node(f.node) {
                    Node::Array { items } => *items,
                    _ => ANY,
                };
                self.start(s, items, b)
            }
            Mode::ArrAfter => match b {
                b',' => {
                    self.top().mode = Mode::ArrValue;
                    true
                }
                b']' => {
                    self.value_done();
                    true
                }
                _ => false,
            },
            Mode::Str { key } => match b {
                b'"' if key => {
                    // A free key ends: its value follows the colon.
                    let t = self.top();
                    t.mode = Mode::Colon;
                    t.prop = 0;
                    true
                }
                b'"' => {
                    self.value_done();
                    true
                }
                b'\\' => {
                    self.top().mode = Mode::Esc { key };
                    true
                }
                _ => b >= 0x20,
            },
            Mode::Esc { key } => {
                self.top().mode = match b {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Mode::Str { key },
                    b'u' => Mode::Hex { key, left: 4 },
                    _ => return false,
                };
                true
            }
            Mode::Hex { key, left } => {
                self.top().mode = if left == 1 {
                    Mode::Str { key }
                } else {
                    Mode::Hex {
                        key,
                        left: left - 1,
                    }
                };
                b.is_ascii_hexdigit()
            }
            Mode::Num(n) => self.number(s, n, f.integer, b),
            Mode::Lit(which) => {
                let lit = LITERALS[which as usize];
                if b != lit[f.pos as usize] {
                    return false;
                }
                if f.pos as usize + 1 == lit.len() {
                    self.value_done();
                } else {
                    self.top().pos += 1;
                }
                true
            }
            Mode::Enum => {
                let Node::Enum(values) = s.node(f.node) else {
                    return false;
                };
                let pos = f.pos as usize;
                let next = (0..values.len())
                    .filter(|&i| f.cand & bit(i) != 0 && values[i].get(pos) == Some(&b))
                    .fold(0, |m, i| m | bit(i));
                if next != 0 {
                    let t = self.top();
                    t.cand = next;
                    t.pos += 1;
                    return true;
                }
                // No value goes on with `b`: one that is complete ends here, and `b` is read
                // after it.
                let complete =
                    (0..values.len()).any(|i| f.cand & bit(i) != 0 && values[i].len() == pos);
                complete && {
                    self.value_done();
                    self.feed(s, b)
                }
            }
        }
    }

    fn number(&mut self, s: &Schema, n: Num, integer: bool, b: u8) -> bool {
        let digit = b.is_ascii_digit();
        let next = match (n, b) {
            (Num::Minus, b'0') => Num::Zero,
            (Num::Minus, _) if digit => Num::Int,
            (Num::Int, _) if digit => Num::Int,
            (Num::Zero | Num::Int, b'.') if !integer => Num::Dot,
            (Num::Dot | Num::Frac, _) if digit => Num::Frac,
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') if !integer => Num::E,
            (Num::E, b'+' | b'-') => Num::ESign,
            (Num::E | Num::ESign | Num::Exp, _) if digit => Num::Exp,
            // A complete number ends at the first byte that cannot extend it, which is then
            // read as what follows the value.
            (Num::Zero | Num::Int | Num::Frac | Num::Exp, _) => {
                self.value_done();
                return self.feed(s, b);
            }
            _ => return false,
        };
        self.top().mode = Mode::Num(next);
        true
    }
}

fn lit(node: NodeId, which: u8) -> Frame {
    let mut f = Frame::new(node, Mode::Lit(which));
    f.pos = 1;
    f
}

impl Schema {
    /// The object node a frame reads (a free object of `Any` is any object).
    fn node_of_object(&self, id: NodeId) -> &Node {
        static FREE: Node = Node::Object {
            props: Vec::new(),
            required: 0,
        };
        match self.node(id) {
            Node::Any => &FREE,
            n => n,
        }
    }
}

/// `response_format` as a request gives it.
#[derive(Debug, Deserialize)]
struct JsonSchemaFormat {
    schema: Option<serde_json::Value>,
}

/// The [`Schema`] of an OpenAI `response_format` object's `json_schema` member
/// (`{"name": ..., "schema": {...}, "strict": ...}`).
pub fn schema_of_response_format(json_schema: &serde_json::Value) -> Result<Schema> {
    let f: JsonSchemaFormat = serde_json::from_value(json_schema.clone())
        .context("json_schema must be an object with a \"schema\"")?;
    Schema::compile(&f.schema.context("json_schema has no \"schema\"")?)
}

/// Sets to `-inf` every logit whose token cannot come next in a JSON output of `schema` at
/// `state`: tokens whose bytes `state` does not accept, special tokens, and end-of-sequence
/// tokens until the object is complete; once it is, every token but end-of-sequence (and,
/// where `ignore_eos`, whitespace). Returns how many tokens remain possible.
pub fn mask(
    state: &JsonState,
    schema: &Schema,
    tok: &Tokenizer,
    ignore_eos: bool,
    logits: &mut [f32],
) -> usize {
    let eos = tok.eos_ids();
    let done = state.complete();
    let vocab = tok.vocab_size();
    // Most tokens fail on their first byte: which first bytes can come next, tried once.
    let first: [bool; 256] = std::array::from_fn(|b| state.accepts(schema, &[b as u8]));
    // Inside a string, a token of plain string bytes goes through without a trial.
    let in_string = state.in_string();
    let plain = |bytes: &[u8]| bytes.iter().all(|&b| b >= 0x20 && b != b'"' && b != b'\\');
    logits
        .par_chunks_mut(4096)
        .enumerate()
        .map(|(c, chunk)| {
            let mut kept = 0;
            for (j, l) in chunk.iter_mut().enumerate() {
                let id = (c * 4096 + j) as u32;
                let ok = if (id as usize) >= vocab {
                    false
                } else if eos.contains(&id) {
                    done && !ignore_eos
                } else if done && !ignore_eos {
                    false
                } else {
                    // Cheapest tests first: most tokens fail on their first byte.
                    let bytes = tok.token_bytes(id);
                    !bytes.is_empty()
                        && first[bytes[0] as usize]
                        && !tok.is_special(id)
                        && ((in_string && plain(bytes)) || state.accepts(schema, bytes))
                };
                if ok {
                    kept += 1;
                } else {
                    *l = f32::NEG_INFINITY;
                }
            }
            kept
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn reads(s: &Schema, text: &str) -> bool {
        let mut st = JsonState::default();
        text.bytes().all(|b| st.feed(s, b)) && st.complete()
    }

    fn prefix_ok(s: &Schema, text: &str) -> bool {
        JsonState::default().accepts(s, text.as_bytes())
    }

    #[test]
    fn any_object_reads_whole_objects() {
        let s = Schema::any_object();
        for t in [
            "{}",
            " { } ",
            r#"{"a": 1}"#,
            r#"{"a": -0.5e+10, "b": [true, false, null, "x\"y\\u00e9"], "c": {"d": []}}"#,
            "{\"k\":\n[1,2 ,3]}\n",
            r#"{"é": "ü ✓"}"#,
            r#"{"n": 0, "m": 10.25E-3, "k\"ey": {}}"#,
        ] {
            assert!(reads(&s, t), "{t}");
        }
        for t in [
            "[]",
            "1",
            "\"x\"",
            "{",
            "{\"a\"}",
            "{\"a\":}",
            "{\"a\":1,}",
            "{\"a\":01}",
            "{\"a\":1.}",
            "{\"a\":-}",
            "{\"a\":tru}",
            "{\"a\":[1,]}",
            "{\"a\":[1}",
            "{a:1}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\u12g4\"}",
            "{\"a\":\"line\nbreak\"}",
            "{}x",
            "{}{}",
        ] {
            assert!(!reads(&s, t), "{t}");
        }
    }

    /// Prefixes: what a token may continue, numbers ending at a delimiter inside the same
    /// token, literals and escapes split over tokens.
    #[test]
    fn prefixes_and_splits() {
        let s = Schema::any_object();
        assert!(prefix_ok(&s, ""));
        assert!(prefix_ok(&s, "  {"));
        assert!(!prefix_ok(&s, "Sure"));
        assert!(prefix_ok(&s, "{\"ke"));
        assert!(prefix_ok(&s, "{\"a\": 12"));
        assert!(prefix_ok(&s, "{\"a\": 12}"));
        assert!(prefix_ok(&s, "{\"a\": fa"));
        assert!(!prefix_ok(&s, "{\"a\": fx"));
        let mut st = JsonState::default();
        for piece in ["{\"a", "\": [1", "2, tr", "ue], \"b\": \"\\u00", "e9\"}"] {
            assert!(st.accepts(&s, piece.as_bytes()), "{piece}");
            piece.bytes().for_each(|b| assert!(st.feed(&s, b)));
        }
        assert!(st.complete());
        assert!(st.accepts(&s, b" \n"));
        assert!(!st.accepts(&s, b","));
        let deep = "{\"a\":".to_string() + &"[".repeat(MAX_DEPTH - 2);
        assert!(prefix_ok(&s, &deep));
        assert!(!prefix_ok(&s, &(deep + "[")));
    }

    fn person() -> Schema {
        Schema::compile(&json!({
            "type": "object",
            "title": "Person",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "description": "years"},
                "nick": {"type": "string"},
                "tags": {"type": "array", "items": {"enum": ["a", "ab", 1, 12, true, null]}},
                "home": {"$ref": "#/$defs/Place"},
                "alive": {"type": "boolean"},
                "spouse": {"type": "null"}
            },
            "required": ["name", "age"],
            "additionalProperties": false,
            "$defs": {
                "Place": {
                    "type": "object",
                    "properties": {"city": {"const": "Paris"}, "near": {"$ref": "#/$defs/Place"}},
                    "required": ["city"]
                }
            }
        }))
        .unwrap()
    }

    #[test]
    fn schema_objects() {
        let s = person();
        for t in [
            r#"{"name": "Ann", "age": 41}"#,
            r#"{"age": -3, "name": "", "nick": "a\"b"}"#,
            r#"{"name": "A", "age": 1, "tags": ["ab", 12, "a", 1, true, null]}"#,
            r#"{"name": "A", "age": 1, "home": {"city": "Paris", "near": {"city": "Paris"}}}"#,
            r#"{"name":"A","age":1,"alive":false,"spouse":null,"tags":[]}"#,
        ] {
            assert!(reads(&s, t), "{t}");
        }
        for t in [
            r#"{"name": "Ann"}"#,                        // age is required
            r#"{"name": "Ann", "age": 4.5}"#,            // an integer
            r#"{"name": "Ann", "age": 4e1}"#,            // an integer
            r#"{"name": "Ann", "age": 4, "name": "B"}"#, // twice
            r#"{"name": "Ann", "age": 4, "x": 1}"#,      // not a property
            r#"{"nam": "Ann", "age": 4}"#,
            r#"{"names": "Ann", "age": 4}"#,
            r#"{"name": 3, "age": 4}"#,
            r#"{"name": "A", "age": 1, "tags": ["b"]}"#,
            r#"{"name": "A", "age": 1, "tags": [123]}"#,
            r#"{"name": "A", "age": 1, "tags": [false]}"#,
            r#"{"name": "A", "age": 1, "home": {"city": "Lyon"}}"#,
            r#"{"name": "A", "age": 1, "home": {}}"#,
            r#"{"name": "A", "age": 1, "alive": null}"#,
            r#"{"name": "A", "age": 1,}"#,
        ] {
            assert!(!reads(&s, t), "{t}");
        }
        // Every property used: no comma can follow.
        assert!(!prefix_ok(
            &s,
            r#"{"name":"A","age":1,"nick":"n","tags":[],"home":{"city":"Paris"},"alive":true,"spouse":null,"#
        ));
        // A key prefix narrows the candidates.
        assert!(prefix_ok(&s, r#"{"na"#));
        assert!(!prefix_ok(&s, r#"{"nx"#));
    }

    /// The mask's shortcuts (first bytes, plain string runs) keep exactly the tokens a full
    /// trial keeps, at every point of an output.
    #[test]
    fn shortcuts_equal_full_trials() {
        let s = person();
        let text = r#"{"name": "A\u00e9 b", "age": -12, "tags": ["ab", 12, null], "home": {"city": "Paris"}}"#;
        let pieces: Vec<Vec<u8>> = [
            "{", "\"", "name", "\":", " \"", "A", "\\u", "00e9", " b", "\",", "age", "12", "-1",
            "2,", "\"ab\"", "[\"", "null", "]", "}", " ", "\n", "tr", "ue", "Paris", "\"}", ", \"",
        ]
        .iter()
        .map(|p| p.as_bytes().to_vec())
        .collect();
        let mut st = JsonState::default();
        for (i, b) in text.bytes().enumerate() {
            let first: [bool; 256] = std::array::from_fn(|c| st.accepts(&s, &[c as u8]));
            for p in &pieces {
                let plain = p.iter().all(|&c| c >= 0x20 && c != b'"' && c != b'\\');
                let fast = first[p[0] as usize] && ((st.in_string() && plain) || st.accepts(&s, p));
                assert_eq!(
                    fast,
                    st.accepts(&s, p),
                    "at byte {i}, piece {:?}",
                    String::from_utf8_lossy(p)
                );
            }
            assert!(st.feed(&s, b), "byte {i}");
        }
        assert!(st.complete());
    }

    /// `Optional[X]` as pydantic writes it (`anyOf` with null) and type lists.
    #[test]
    fn unions() {
        let s = Schema::compile(&json!({
            "type": "object",
            "properties": {
                "a": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": null},
                "b": {"type": ["integer", "null"]},
                "c": {"anyOf": [{"$ref": "#/$defs/P"}, {"type": "array", "items": {"type": "boolean"}}, {"enum": [1, 2]}]}
            },
            "required": ["a", "b"],
            "$defs": {"P": {"type": "object", "properties": {"x": {"type": "number"}}}}
        }))
        .unwrap();
        for t in [
            r#"{"a": "s", "b": 1}"#,
            r#"{"a": null, "b": null, "c": {"x": 1.5}}"#,
            r#"{"a": null, "b": -2, "c": [true, false]}"#,
            r#"{"a": "", "b": 0, "c": 2}"#,
        ] {
            assert!(reads(&s, t), "{t}");
        }
        for t in [
            r#"{"a": 1, "b": 1}"#,
            r#"{"a": null, "b": 1.5}"#,
            r#"{"a": null, "b": "x"}"#,
            r#"{"a": null, "b": 1, "c": 3}"#,
            r#"{"a": null, "b": 1, "c": [1]}"#,
            r#"{"a": null, "b": 1, "c": "p"}"#,
        ] {
            assert!(!reads(&s, t), "{t}");
        }
    }

    #[test]
    fn unsupported_schemas_are_refused() {
        for (s, what) in [
            (json!({"type": "array"}), "root"),
            (
                json!({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}),
                "maxLength",
            ),
            (
                json!({"type": "object", "properties": {"a": {"anyOf": []}}}),
                "alternatives",
            ),
            (
                json!({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"enum": ["x"]}]}}}),
                "start differently",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": ["integer", "number"]}}}),
                "start differently",
            ),
            (
                json!({"type": "object", "properties": {"a": {"anyOf": [{}, {"type": "null"}]}}}),
                "start differently",
            ),
            (
                json!({"type": "object", "required": ["b"], "properties": {"a": {}}}),
                "required",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
                "$ref",
            ),
            (
                json!({"type": "object", "properties": {"a\"b": {}}}),
                "escapes",
            ),
        ] {
            let e = Schema::compile(&s).unwrap_err().to_string();
            assert!(e.contains(what), "{s}: {e}");
        }
        assert!(schema_of_response_format(&json!({"name": "x"})).is_err());
        assert!(
            schema_of_response_format(&json!({"name": "x", "schema": {"type": "object"}})).is_ok()
        );
    }
}
