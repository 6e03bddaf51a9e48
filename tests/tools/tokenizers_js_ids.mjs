// Ids that HF's JavaScript port of tokenizers (npm @huggingface/tokenizers) gives for a corpus,
// for a cross-check of zerotrain's encoder on real tokenizer files where the Rust library is
// not at hand (it is on the GPU machine: tests/tools/check_hf_outputs.py is the reference).
//
//   node tests/tools/tokenizers_js_ids.mjs NODE_MODULES_DIR REAL_DIR CORPUS.jsonl OUT.json NAME...
//
// REAL_DIR/<NAME>/ holds tokenizer.json and tokenizer_config.json (tests/tools/
// fetch_real_tokenizers.sh); CORPUS.jsonl has {"text": ...} lines. OUT.json:
// {"<NAME>": [[ids of line 1], ...] | {"error": "..."}}.
import fs from "fs";
import path from "path";
import { pathToFileURL } from "url";

const [modules, real, corpus, out, ...names] = process.argv.slice(2);
const { Tokenizer } = await import(
  pathToFileURL(path.join(modules, "@huggingface/tokenizers/dist/tokenizers.mjs")).href
);
const texts = fs
  .readFileSync(corpus, "utf8")
  .split("\n")
  .filter((l) => l.trim().length > 0)
  .map((l) => JSON.parse(l).text);
const result = {};
for (const name of names) {
  try {
    const json = JSON.parse(fs.readFileSync(path.join(real, name, "tokenizer.json"), "utf8"));
    const config = JSON.parse(fs.readFileSync(path.join(real, name, "tokenizer_config.json"), "utf8"));
    const tok = new Tokenizer(json, config);
    result[name] = texts.map((t) => Array.from(tok.encode(t, { add_special_tokens: false }).ids));
  } catch (e) {
    result[name] = { error: String(e) };
  }
}
fs.writeFileSync(out, JSON.stringify(result));
