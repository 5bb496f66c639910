//! Chat templates against the jinja2 oracle (`tools/chat_template_check.py` renders the same
//! conversations with HF transformers' jinja2 settings into `chat_expected.json`), and the
//! SmolLM2 prompt ids end to end when the SmolLM2 GGUF is available.

mod common;

use common::{data_dir, qwen3_json_tokenizer, smollm2_gguf};
use ferrite_tokenizer::{ChatMessage, ChatTemplate, RenderOptions, Tokenizer};
use serde_json::Value;

fn template_source(name: &str) -> String {
    match name {
        "smollm2" => {
            std::fs::read_to_string(data_dir().join("smollm2/chat_template.jinja")).unwrap()
        }
        "qwen3" => {
            let cfg: Value = serde_json::from_str(
                &std::fs::read_to_string(data_dir().join("qwen3-json/tokenizer_config.json"))
                    .unwrap(),
            )
            .unwrap();
            cfg["chat_template"].as_str().unwrap().to_string()
        }
        other => panic!("unknown template {other}"),
    }
}

#[test]
fn templates_match_jinja2_oracle() {
    let expected: Value = serde_json::from_str(
        &std::fs::read_to_string(data_dir().join("chat_expected.json")).unwrap(),
    )
    .unwrap();
    let mut n = 0;
    for case in expected["cases"].as_array().unwrap() {
        let tname = case["template"].as_str().unwrap();
        let cname = case["conversation"].as_str().unwrap();
        let messages: Vec<ChatMessage> =
            serde_json::from_value(expected["conversations"][cname].clone()).unwrap();
        let tmpl = ChatTemplate::new(&template_source(tname)).unwrap();
        let (bos, eos) = match tname {
            "smollm2" => (Some("<|im_start|>"), Some("<|im_end|>")),
            _ => (None, Some("<|im_end|>")),
        };
        let opts = RenderOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            bos_token: bos.map(str::to_string),
            eos_token: eos.map(str::to_string),
            enable_thinking: case["enable_thinking"].as_bool(),
            // serde_json (without preserve_order) sorts keys, so the tools go in as the
            // oracle's text, in Python's insertion order.
            tools: case["tools"]
                .as_bool()
                .unwrap()
                .then(|| TOOLS_JSON.to_string()),
            ..Default::default()
        };
        let got = tmpl.render(&messages, &opts).unwrap();
        assert_eq!(
            got,
            case["expected"].as_str().unwrap(),
            "{tname} / {cname} / {opts:?}"
        );
        n += 1;
    }
    eprintln!("{n} chat-template cases match jinja2");
    assert!(n >= 20);
}

/// `TOOLS` of chat_template_check.py, keys in its insertion order.
const TOOLS_JSON: &str = r#"[{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]"#;

#[test]
fn qwen3_prompts_by_reading_the_template() {
    // Written by hand from the template's logic, independent of the oracle file.
    let tmpl = ChatTemplate::new(&template_source("qwen3")).unwrap();
    let gen = RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let one = [ChatMessage::new("user", "hi")];
    assert_eq!(
        tmpl.render(&one, &gen).unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let sys = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "hi"),
    ];
    assert_eq!(
        tmpl.render(&sys, &gen).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    // Reasoning of an assistant turn before the last user query is dropped.
    let multi = [
        ChatMessage::new("user", "What is 2+2?"),
        ChatMessage::new("assistant", "<think>\nSimple arithmetic.\n</think>\n\n4"),
        ChatMessage::new("user", "And 3+3?"),
    ];
    assert_eq!(
        tmpl.render(&multi, &gen).unwrap(),
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n\
         <|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
    );
    let no_think = RenderOptions {
        add_generation_prompt: true,
        enable_thinking: Some(false),
        ..Default::default()
    };
    assert_eq!(
        tmpl.render(&one, &no_think).unwrap(),
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    // The same through the kwargs (a request's chat_template_kwargs), which cannot replace
    // the messages.
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("enable_thinking".into(), false.into());
    kwargs.insert("messages".into(), serde_json::json!([]));
    let by_kwargs = RenderOptions {
        add_generation_prompt: true,
        kwargs,
        ..Default::default()
    };
    assert_eq!(
        tmpl.render(&one, &by_kwargs).unwrap(),
        tmpl.render(&one, &no_think).unwrap()
    );
}

#[test]
fn qwen3_rendered_prompt_tokenizes_with_special_tokens() {
    let tok = qwen3_json_tokenizer();
    let tmpl = tok.compile_chat_template().unwrap().unwrap();
    let prompt = tmpl
        .render(&[ChatMessage::new("user", "hi")], &tok.render_options(true))
        .unwrap();
    let ids = tok.encode(&prompt, false, true).unwrap();
    let im_start = tok.token_to_id("<|im_start|>").unwrap();
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == im_start).count(), 2);
    assert_eq!(ids.iter().filter(|&&i| i == im_end).count(), 1);
    assert_eq!(tok.decode(&ids, false).unwrap(), prompt);
}

#[test]
fn bad_templates_are_errors_not_panics() {
    assert!(ChatTemplate::new("{% for x in %}").is_err());
    let t = ChatTemplate::new("{{ messages[0].content.nosuchmethod() }}").unwrap();
    assert!(t
        .render(&[ChatMessage::new("user", "x")], &RenderOptions::default())
        .is_err());
    let t = ChatTemplate::new("{{ tools | tojson }}").unwrap();
    let opts = RenderOptions {
        tools: Some("not json".into()),
        ..Default::default()
    };
    assert!(t.render(&[], &opts).is_err());
}

/// The ids SmolLM2-135M-Instruct's reference prompt must tokenize to:
/// "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n".
const SMOLLM2_PROMPT_IDS: [u32; 16] = [
    1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
];

#[test]
fn smollm2_gguf_prompt_ids() {
    let Some(path) = smollm2_gguf() else { return };
    let file = ferrite_formats::gguf::GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    // The committed template is the one in the GGUF.
    assert_eq!(tok.chat_template().unwrap(), template_source("smollm2"));

    let bare =
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(tok.encode(bare, false, true).unwrap(), SMOLLM2_PROMPT_IDS);
    assert_eq!(tok.decode(&SMOLLM2_PROMPT_IDS, false).unwrap(), bare);

    // HF's rendering of SmolLM2's template inserts its default system message when the
    // conversation has none; the reference ids are that prompt without the system turn.
    let tmpl = tok.compile_chat_template().unwrap().unwrap();
    let msgs = [ChatMessage::new("user", "What is the capital of France?")];
    let rendered = tmpl.render(&msgs, &tok.render_options(true)).unwrap();
    let ids = tok.encode(&rendered, false, true).unwrap();
    assert!(rendered.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
    assert!(ids.ends_with(&SMOLLM2_PROMPT_IDS), "{ids:?}");

    // Plain-text tokenization (llama.cpp `tokenize` semantics) of a few strings.
    assert_eq!(
        tok.encode("Hello world! 123", false, false).unwrap(),
        [19556, 905, 17, 216, 33, 34, 35]
    );
    let end = tok.token_to_id("<|im_end|>").unwrap();
    assert!(tok.eos_ids().contains(&end), "{:?}", tok.eos_ids());
}
