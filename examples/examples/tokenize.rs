//! Your own text as training tokens (nanoGPT's `prepare.py`, in Rust): a UTF-8 text file or a
//! directory of them, tokenized with a Hugging Face `tokenizer.json` — each file a document,
//! the end-of-text token after each — and written as a token file: nanoGPT's flat array (u16
//! ids, u32 above 65536 tokens) or llm.c's (its 1024-byte header). Prints the documents, the
//! tokens and how many training sequences of `--seq` tokens they make.
//!
//! ```sh
//! cargo run --release -p bonfire-examples --example tokenize -- \
//!     --tokenizer tokenizer.json --text my-corpus/ --out train.bin [--llmc] [--seq 1024]
//! ```

use bonfire_data::{PackedSequences, TextCorpus, TokenFormat, TokenWidth, Tokenizer, write_tokens};
use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(about = "Tokenize text files into a nanoGPT / llm.c token file")]
struct Cli {
    /// A Hugging Face `tokenizer.json`.
    #[arg(long)]
    tokenizer: PathBuf,
    /// A UTF-8 text file, or a directory of them (each file one document).
    #[arg(long)]
    text: PathBuf,
    /// The token file to write.
    #[arg(long)]
    out: PathBuf,
    /// Write llm.c's format (a 1024-byte header) instead of nanoGPT's flat array.
    #[arg(long)]
    llmc: bool,
    /// Tokens per training sequence, for the count printed.
    #[arg(long, default_value_t = 1024)]
    seq: usize,
}

fn run(cli: &Cli) -> Result<String, Box<dyn std::error::Error>> {
    let tokenizer = Tokenizer::from_file(&cli.tokenizer)?;
    let corpus = TextCorpus::open(&cli.text, &tokenizer)?;
    let documents = corpus.documents().len();
    let ids = corpus.tokens().to_vec();
    let format = if cli.llmc {
        TokenFormat::LlmC
    } else {
        TokenFormat::Raw
    };
    let width = TokenWidth::for_vocab(tokenizer.vocab_size());
    write_tokens(&cli.out, &ids, width, format)?;
    let sequences = PackedSequences::new(corpus.into_tokens(), cli.seq, 0).map_or(0, |p| p.len());
    Ok(format!(
        "tokenize documents={documents} tokens={} vocab={} out={} sequences_of_{}={sequences}",
        ids.len(),
        tokenizer.vocab_size(),
        cli.out.display(),
        cli.seq
    ))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
