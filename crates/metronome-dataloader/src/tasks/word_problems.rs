//! Word problems: grade-school arithmetic stories in the style of GSM8K ("Maya buys 4
//! notebooks at $3 each and pays with a $20 bill. How much change does she get?"),
//! each solved by 1 to 4 whole-number operations (2 to 4 unless `steps` asks for
//! one-operation stories, which a model too small for two-step problems starts from).
//!
//! Every problem is drawn from one of a fixed set of templates (buying, sharing,
//! rates, ages, leftovers, wages, travel, ...), with names, objects and wording varied,
//! and its numbers chosen so that every intermediate result is a non-negative integer
//! (a division always comes out exact, a subtraction never goes below zero). Besides
//! the question, a template records its solution as the operations it performed
//! (`4*3=12; 20-12=8`, GSM8K's calculator annotations), which tests recompute
//! independently and a warm start or a reader can show.
//!
//! The held-out partition is keyed by the template and its given numbers, not the
//! wording: a held-out problem is never trained on under other names or objects.

use std::collections::BTreeMap;
use std::fmt;

use metronome_core::{PromptId, RunSeed, stream_seed};
use serde::{Deserialize, Serialize};

use super::{Holdout, Operator, Span, render};
use crate::dataset::{Dataset, PromptContent, Record};
use crate::error::{Error, Result};
use crate::rng::SplitMix64;

/// The [`stream_seed`] stream of word problems; the index is the item.
pub const WORD_PROBLEM_STREAM: u64 = 0x776f_7264_7072_6f62; // "wordprob"

/// Draws per item before giving up on landing in the configured split.
const SPLIT_ATTEMPTS: usize = 10_000;

/// The fewest and most operations a template's solution takes.
const STEPS: (u64, u64) = (1, 4);

/// The default `steps`: the multi-step stories GSM8K is made of.
const DEFAULT_STEPS: (u64, u64) = (2, 4);

/// The default prompt: the question, then the answer format the math verifier of
/// `metronome-reward` reads first among plain-text forms (the rest of the line after
/// the last `####`, GSM8K's convention).
pub const DEFAULT_WORD_PROBLEM_FORMAT: &str = "{question}\nSolve the problem step by step. Then write the \
     final answer as a whole number on a last line of the form \"#### N\", where N is the number alone.";

/// Knobs of the word-problem task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WordProblemConfig {
    /// Items per epoch.
    pub size: u64,
    /// Operations a solution takes (1 to 4; default 2 to 4): each item draws a count
    /// uniformly from this range, then a template with that many operations.
    pub steps: Span,
    /// Caps the numbers a question states at this value (each drawn range's upper end,
    /// never below its lower end; results may exceed it): small numbers for a model too
    /// small for two-digit arithmetic. `None`: each template's own ranges.
    pub max_number: Option<u64>,
    /// The prompt text; `{question}` becomes the problem. The default asks for the
    /// answer on a last line `#### N`.
    pub format: String,
    /// Generate items from this seed instead of the run seed.
    pub seed: Option<u64>,
    /// Draw only training or only held-out problems (default: all). The content key is
    /// the template and its numbers, so a held-out problem is not trained on in other
    /// words.
    pub holdout: Holdout,
}

impl Default for WordProblemConfig {
    fn default() -> Self {
        Self {
            size: 10_000,
            steps: Span::new(DEFAULT_STEPS.0, DEFAULT_STEPS.1),
            max_number: None,
            format: DEFAULT_WORD_PROBLEM_FORMAT.into(),
            seed: None,
            holdout: Holdout::default(),
        }
    }
}

impl WordProblemConfig {
    /// Checks every knob; errors name the key.
    pub fn validate(&self) -> Result<()> {
        if self.size == 0 {
            return Err(Error::config("word_problems.size", "must be at least 1"));
        }
        self.steps.check("word_problems.steps", STEPS.0, STEPS.1)?;
        if self.max_number == Some(0) {
            return Err(Error::config("word_problems.max_number", "must be at least 1 (or absent)"));
        }
        if !self.format.contains("{question}") {
            return Err(Error::config("word_problems.format", "must contain `{question}`"));
        }
        self.holdout.check("word_problems.holdout")
    }
}

/// One operation of a solution: `left op right = result`, all non-negative integers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkStep {
    /// The left operand.
    pub left: u64,
    /// The operator (`/` only when exact).
    pub op: Operator,
    /// The right operand.
    pub right: u64,
    /// The result.
    pub result: u64,
}

impl fmt::Display for WorkStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}={}", self.left, self.op.symbol(), self.right, self.result)
    }
}

/// One word problem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WordProblem {
    /// The template it was drawn from, e.g. `change`.
    pub template: &'static str,
    /// The problem text.
    pub question: String,
    /// The solution's operations in order; the last one's result is the answer.
    pub steps: Vec<WorkStep>,
    /// The numbers the question gives, in the order they were drawn.
    pub givens: Vec<u64>,
}

impl WordProblem {
    /// The answer: the last operation's result.
    #[must_use]
    pub fn answer(&self) -> u64 {
        self.steps.last().map_or(0, |s| s.result)
    }

    /// The solution as GSM8K's calculator annotations: `4*3=12; 20-12=8`.
    #[must_use]
    pub fn solution(&self) -> String {
        self.steps.iter().map(WorkStep::to_string).collect::<Vec<_>>().join("; ")
    }

    /// The content key of the train / held-out partition: the template and its given
    /// numbers, e.g. `change:4,3,20` (names, objects and wording left out).
    #[must_use]
    pub fn key(&self) -> String {
        let givens: Vec<String> = self.givens.iter().map(u64::to_string).collect();
        format!("{}:{}", self.template, givens.join(","))
    }
}

/// The word-problem task as a [`Dataset`] of `size` items.
#[derive(Clone, Debug)]
pub struct WordProblemTask {
    config: WordProblemConfig,
    seed: RunSeed,
}

impl WordProblemTask {
    /// The task with `config`, seeded by `config.seed` or else `run`.
    pub fn new(config: WordProblemConfig, run: RunSeed) -> Result<Self> {
        config.validate()?;
        let seed = config.seed.map_or(run, RunSeed);
        Ok(Self { config, seed })
    }

    /// Item `index`. An error only when the configured split holds almost none of the
    /// item space.
    pub fn item(&self, index: u64) -> Result<WordProblem> {
        let c = &self.config;
        let mut rng = SplitMix64::new(stream_seed(self.seed, WORD_PROBLEM_STREAM, index));
        for _ in 0..SPLIT_ATTEMPTS {
            let steps = rng.between(c.steps.min, c.steps.max) as usize;
            let candidates: Vec<&Template> = TEMPLATES.iter().filter(|t| t.steps == steps).collect();
            let template = candidates[rng.below(candidates.len() as u64) as usize];
            let mut draw = Draw { rng: &mut rng, steps: Vec::new(), givens: Vec::new(), cap: c.max_number };
            let question = (template.write)(&mut draw);
            let problem =
                WordProblem { template: template.name, question, steps: draw.steps, givens: draw.givens };
            debug_assert_eq!(problem.steps.len(), steps, "template {} miscounts its steps", template.name);
            if c.holdout.admits(&problem.key()) {
                return Ok(problem);
            }
        }
        Err(Error::Generator {
            task: "word_problems",
            item: index,
            reason: format!("no problem in the {:?} split after {SPLIT_ATTEMPTS} draws", c.holdout.split),
        })
    }
}

impl Dataset for WordProblemTask {
    fn len(&self) -> usize {
        usize::try_from(self.config.size).unwrap_or(usize::MAX)
    }

    fn record(&self, index: usize) -> Result<Record> {
        let problem = self.item(index as u64)?;
        let text = render(&self.config.format, &[("question", &problem.question)]);
        let metadata = BTreeMap::from([
            ("task".to_owned(), "word_problems".to_owned()),
            ("template".to_owned(), problem.template.to_owned()),
            ("steps".to_owned(), problem.steps.len().to_string()),
            ("solution".to_owned(), problem.solution()),
            ("question".to_owned(), problem.question.clone()),
        ]);
        Ok(Record {
            id: PromptId(index as u64),
            content: PromptContent::Text(text),
            reference: Some(problem.answer().to_string()),
            metadata,
        })
    }

    fn place(&self, index: usize) -> String {
        format!("word_problems item {index}")
    }
}

// ---------------------------------------------------------------------------------
// Drawing: numbers the question gives, and the operations that solve it.

struct Draw<'a> {
    rng: &'a mut SplitMix64,
    steps: Vec<WorkStep>,
    givens: Vec<u64>,
    /// `max_number`.
    cap: Option<u64>,
}

impl Draw<'_> {
    /// A number the question states, uniform in `lo..=hi` (`hi` lowered to the cap, but
    /// not below `lo`).
    fn given(&mut self, lo: u64, hi: u64) -> u64 {
        let hi = self.cap.map_or(hi, |cap| hi.min(cap.max(lo)));
        let n = self.rng.between(lo, hi);
        self.givens.push(n);
        n
    }

    /// A number the question states, computed by the template (a price that makes
    /// the change positive, a count that makes a share exact).
    fn stated(&mut self, n: u64) -> u64 {
        self.givens.push(n);
        n
    }

    /// A uniform choice of wording, name or object.
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.rng.below(items.len() as u64) as usize]
    }

    fn below(&mut self, n: u64) -> u64 {
        self.rng.below(n)
    }

    fn person(&mut self) -> Person {
        self.pick(PEOPLE)
    }

    /// Two different people.
    fn two_people(&mut self) -> (Person, Person) {
        let a = self.person();
        loop {
            let b = self.person();
            if b.name != a.name {
                return (a, b);
            }
        }
    }

    fn step(&mut self, left: u64, op: Operator, right: u64, result: u64) -> u64 {
        self.steps.push(WorkStep { left, op, right, result });
        result
    }

    fn add(&mut self, a: u64, b: u64) -> u64 {
        self.step(a, Operator::Add, b, a + b)
    }

    /// `a - b`; templates draw their numbers so that `b <= a`.
    fn sub(&mut self, a: u64, b: u64) -> u64 {
        debug_assert!(b <= a, "{a}-{b} would be negative");
        self.step(a, Operator::Sub, b, a.saturating_sub(b))
    }

    fn mul(&mut self, a: u64, b: u64) -> u64 {
        self.step(a, Operator::Mul, b, a * b)
    }

    /// `a / b`; templates draw their numbers so that it is exact.
    fn div(&mut self, a: u64, b: u64) -> u64 {
        debug_assert!(b > 0 && a.is_multiple_of(b), "{a}/{b} is not exact");
        self.step(a, Operator::Div, b, a / b.max(1))
    }
}

#[derive(Clone, Copy)]
struct Person {
    name: &'static str,
    /// `she` / `he`.
    they: &'static str,
    /// `her` / `his`.
    their: &'static str,
}

const fn she(name: &'static str) -> Person {
    Person { name, they: "she", their: "her" }
}

const fn he(name: &'static str) -> Person {
    Person { name, they: "he", their: "his" }
}

const PEOPLE: &[Person] = &[
    she("Maya"),
    she("Olivia"),
    she("Priya"),
    she("Sofia"),
    she("Amara"),
    she("Lena"),
    she("Grace"),
    she("Hana"),
    she("Chloe"),
    she("Zoe"),
    he("Liam"),
    he("Noah"),
    he("Mateo"),
    he("Ethan"),
    he("Kenji"),
    he("Omar"),
    he("Lucas"),
    he("Daniel"),
    he("Tariq"),
    he("Ben"),
];

/// `she` → `She`.
fn capital(word: &str) -> String {
    let mut chars = word.chars();
    chars.next().map(|c| c.to_ascii_uppercase().to_string() + chars.as_str()).unwrap_or_default()
}

/// A template: its name, how many operations its solution takes, and how it writes a
/// problem while recording the operations.
struct Template {
    name: &'static str,
    steps: usize,
    write: fn(&mut Draw<'_>) -> String,
}

const TEMPLATES: &[Template] = &[
    // One operation.
    Template { name: "more", steps: 1, write: more },
    Template { name: "gave_away", steps: 1, write: gave_away },
    Template { name: "packs", steps: 1, write: packs },
    Template { name: "split", steps: 1, write: split },
    // Two operations.
    Template { name: "change", steps: 2, write: change },
    Template { name: "share", steps: 2, write: share },
    Template { name: "machine", steps: 2, write: machine },
    Template { name: "age_later", steps: 2, write: age_later },
    Template { name: "album", steps: 2, write: album },
    Template { name: "class", steps: 2, write: class },
    // Three operations.
    Template { name: "two_items", steps: 3, write: two_items },
    Template { name: "savings", steps: 3, write: savings },
    Template { name: "garden", steps: 3, write: garden },
    Template { name: "travel", steps: 3, write: travel },
    Template { name: "muffins", steps: 3, write: muffins },
    Template { name: "tank", steps: 3, write: tank },
    // Four operations.
    Template { name: "balloons", steps: 4, write: balloons },
    Template { name: "wages", steps: 4, write: wages },
    Template { name: "three_ages", steps: 4, write: three_ages },
    Template { name: "bookshop", steps: 4, write: bookshop },
];

fn more(d: &mut Draw<'_>) -> String {
    let p = d.person();
    let thing = d.pick(&["apples", "stickers", "marbles", "books", "shells", "pencils"]);
    let had = d.given(2, 40);
    let got = d.given(1, 30);
    d.add(had, got);
    let how = d.pick(&["buys", "is given", "finds"]);
    format!(
        "{name} has {had} {thing}. {They} {how} {got} more. How many {thing} does {they} have now?",
        name = p.name,
        They = capital(p.they),
        they = p.they
    )
}

fn gave_away(d: &mut Draw<'_>) -> String {
    let (a, b) = d.two_people();
    let thing = d.pick(&["cookies", "cards", "balloons", "stamps", "crayons", "toy cars"]);
    let had = d.given(3, 50);
    // At least one left: the answer is never zero.
    let gave = d.given(1, had - 1);
    d.sub(had, gave);
    format!(
        "{an} has {had} {thing} and gives {gave} of them to {bn}. How many {thing} does {an} have left?",
        an = a.name,
        bn = b.name
    )
}

fn packs(d: &mut Draw<'_>) -> String {
    let p = d.person();
    let (pack, thing) =
        d.pick(&[("boxes", "pens"), ("bags", "oranges"), ("packs", "cards"), ("jars", "candies")]);
    let n = d.given(2, 12);
    let each = d.given(2, 12);
    d.mul(n, each);
    format!(
        "{name} buys {n} {pack} with {each} {thing} in each. How many {thing} does {they} buy in all?",
        name = p.name,
        they = p.they
    )
}

fn split(d: &mut Draw<'_>) -> String {
    let p = d.person();
    let thing = d.pick(&["grapes", "beads", "crackers", "coins", "blocks"]);
    let k = d.given(2, 9);
    let each = d.rng.between(1, 12);
    let total = d.stated(k * each);
    d.div(total, k);
    let into = d.pick(&["bowls", "boxes", "piles", "bags"]);
    format!(
        "{name} puts {total} {thing} into {k} {into}, the same number in each. How many {thing} are in each of \
         the {into}?",
        name = p.name
    )
}

fn change(d: &mut Draw<'_>) -> String {
    let p = d.person();
    let item = d.pick(&["notebooks", "pens", "apples", "comic books", "candles", "mugs", "toy cars"]);
    let verb = d.pick(&["buys", "picks up", "orders"]);
    let n = d.given(2, 12);
    let price = d.given(2, 30);
    let cost = d.mul(n, price);
    // The smallest note that covers the cost, or one of the next two above it.
    let notes = [10, 20, 50, 100, 200, 500];
    let first = notes.iter().position(|&b| b > cost).unwrap_or(notes.len() - 1);
    let last = (first + 2).min(notes.len() - 1);
    let choice = first + d.below((last - first + 1) as u64) as usize;
    let bill = d.stated(notes[choice]);
    d.sub(bill, cost);
    let ask =
        d.pick(&["How much change does {they} get", "How many dollars of change should {they} receive"]);
    format!(
        "{name} {verb} {n} {item} at ${price} each and pays with a ${bill} bill. {ask}?",
        name = p.name,
        ask = ask.replace("{they}", p.they)
    )
}

fn share(d: &mut Draw<'_>) -> String {
    let p = d.person();
    let thing = d.pick(&["marbles", "stickers", "cookies", "seashells", "trading cards", "grapes"]);
    let k = d.given(2, 8);
    let each = d.rng.between(2, 15);
    let total = k * each;
    let a = d.given(1, total - 1);
    let b = d.stated(total - a);
    let sum = d.add(a, b);
    d.div(sum, k);
    let whom = d.pick(&["friends", "cousins", "classmates", "neighbours"]);
    format!(
        "{name} has {a} {thing} and is given {b} more. {They} shares all of them equally among {k} {whom}. \
         How many {thing} does each of them get?",
        name = p.name,
        They = capital(p.they)
    )
}

fn machine(d: &mut Draw<'_>) -> String {
    let thing = d.pick(&["bottles", "toys", "bricks", "buttons", "boxes", "cups"]);
    let what = d.pick(&["A machine", "A factory line", "A robot"]);
    let rate = d.given(5, 60);
    let hours = d.given(2, 9);
    let made = d.mul(rate, hours);
    let faulty = d.given(1, (made / 4).max(1));
    d.sub(made, faulty);
    format!(
        "{what} makes {rate} {thing} every hour. It runs for {hours} hours, and {faulty} of the {thing} it makes \
         are faulty and thrown away. How many good {thing} are left?"
    )
}

fn age_later(d: &mut Draw<'_>) -> String {
    let (a, b) = d.two_people();
    let x = d.given(2, 15);
    let k = d.given(2, 5);
    let now = d.mul(x, k);
    let y = d.given(1, 30);
    d.add(now, y);
    let relation = d.pick(&["aunt", "uncle", "older cousin", "neighbour", "teacher"]);
    format!(
        "{an} is {x} years old. {an}'s {relation} {bn} is {k} times as old as {an}. How old will {bn} be in {y} \
         years?",
        an = a.name,
        bn = b.name
    )
}

fn album(d: &mut Draw<'_>) -> String {
    let p = d.person();
    let thing = d.pick(&["stickers", "stamps", "photos", "postcards"]);
    let per = d.rng.between(3, 12);
    let pages = d.rng.between(2, 10);
    let extra = d.rng.between(1, per * pages / 2);
    let total = d.stated(per * pages + extra);
    let per = d.stated(per);
    let pages = d.stated(pages);
    let used = d.mul(per, pages);
    d.sub(total, used);
    format!(
        "{name} has {total} {thing}. {They} puts {per} {thing} on each page of an album that has {pages} pages \
         and fills every page. How many {thing} are left over?",
        name = p.name,
        They = capital(p.they)
    )
}

fn class(d: &mut Draw<'_>) -> String {
    let groups = d.given(3, 12);
    let size = d.given(3, 12);
    let all = d.mul(groups, size);
    let absent = d.given(1, all / 3);
    d.sub(all, absent);
    let place = d.pick(&["A class", "A sports club", "A choir", "A scout troop"]);
    format!(
        "{place} is split into {groups} groups of {size} children. On Friday {absent} children are absent. How \
         many children are there on Friday?"
    )
}

fn two_items(d: &mut Draw<'_>) -> String {
    let p = d.person();
    let (first, second) = d.pick(&[
        ("pencils", "erasers"),
        ("apples", "oranges"),
        ("shirts", "hats"),
        ("cupcakes", "juice boxes"),
        ("plants", "pots"),
    ]);
    let n1 = d.given(2, 9);
    let p1 = d.given(1, 20);
    let n2 = d.given(2, 9);
    let p2 = d.given(1, 20);
    let a = d.mul(n1, p1);
    let b = d.mul(n2, p2);
    d.add(a, b);
    format!(
        "{name} buys {n1} {first} for ${p1} each and {n2} {second} for ${p2} each. How many dollars does {they} \
         spend in all?",
        name = p.name,
        they = p.they
    )
}

fn savings(d: &mut Draw<'_>) -> String {
    let p = d.person();
    let start = d.given(5, 60);
    let weekly = d.given(3, 25);
    let weeks = d.given(2, 10);
    let saved = d.mul(weekly, weeks);
    let total = d.add(start, saved);
    let spent = d.given(1, total - 1);
    d.sub(total, spent);
    let thing = d.pick(&["a bike helmet", "a board game", "a pair of shoes", "a book set", "a jacket"]);
    format!(
        "{name} has ${start} in {their} piggy bank. {They} adds ${weekly} every week for {weeks} weeks, then \
         spends ${spent} on {thing}. How many dollars does {they} have left?",
        name = p.name,
        their = p.their,
        They = capital(p.they),
        they = p.they
    )
}

fn garden(d: &mut Draw<'_>) -> String {
    let p = d.person();
    let plant = d.pick(&["tomato plants", "rose bushes", "lettuces", "sunflowers", "pepper plants"]);
    let rows = d.given(2, 15);
    let per = d.given(4, 20);
    let removed = d.given(1, per - 1);
    let all = d.mul(rows, per);
    let gone = d.mul(rows, removed);
    d.sub(all, gone);
    let verb = d.pick(&["digs up", "gives away", "moves"]);
    format!(
        "{name}'s garden has {rows} rows with {per} {plant} in each row. {They} {verb} {removed} {plant} from \
         every row. How many {plant} are still in the rows?",
        name = p.name,
        They = capital(p.they)
    )
}

fn travel(d: &mut Draw<'_>) -> String {
    let vehicle = d.pick(&["A train", "A bus", "A car", "A truck"]);
    let v1 = d.given(30, 90);
    let h1 = d.given(1, 5);
    let v2 = d.given(30, 90);
    let h2 = d.given(1, 5);
    let first = d.mul(v1, h1);
    let second = d.mul(v2, h2);
    d.add(first, second);
    format!(
        "{vehicle} travels at {v1} kilometres per hour for {h1} hours, then at {v2} kilometres per hour for {h2} \
         hours. How many kilometres does it travel in total?"
    )
}

fn muffins(d: &mut Draw<'_>) -> String {
    let p = d.person();
    let baked = d.pick(&["muffins", "cookies", "rolls", "tarts"]);
    let trays = d.given(2, 8);
    let per = d.given(4, 15);
    let made = d.mul(trays, per);
    let k = d.rng.between(2, (made / 2).min(9));
    // Eats what the share leaves over, plus up to two more shares (at least one, and
    // fewer than were made), so the rest divides exactly.
    let least = match made % k {
        0 => k,
        r => r,
    };
    let more = d.rng.between(0, 2);
    let eaten = (0..=more).rev().map(|j| least + j * k).find(|&e| e < made).unwrap_or(least);
    let eaten = d.stated(eaten);
    let k = d.stated(k);
    let rest = d.sub(made, eaten);
    d.div(rest, k);
    format!(
        "{name} bakes {trays} trays of {baked} with {per} {baked} on each tray. {They} eats {eaten} of them and \
         shares the rest equally among {k} neighbours. How many {baked} does each neighbour get?",
        name = p.name,
        They = capital(p.they)
    )
}

fn tank(d: &mut Draw<'_>) -> String {
    let rate = d.given(3, 20);
    let minutes = d.given(2, 10);
    let poured = d.mul(rate, minutes);
    let leak = d.given(1, poured / 2);
    let inside = d.sub(poured, leak);
    let room = d.rng.between(5, 200);
    let capacity = d.stated(inside + room);
    d.sub(capacity, inside);
    let vessel = d.pick(&["A water tank", "A fish tank", "A rain barrel", "A pool"]);
    format!(
        "{vessel} holds {capacity} litres and starts empty. Water flows in at {rate} litres per minute for \
         {minutes} minutes, and {leak} litres leak out. How many more litres are needed to fill it?"
    )
}

fn balloons(d: &mut Draw<'_>) -> String {
    let p = d.person();
    let packs = d.given(2, 8);
    let per = d.given(5, 20);
    let loose = d.given(1, 9);
    let bought = d.mul(packs, per);
    let all = d.add(bought, loose);
    let k = d.rng.between(3, 8);
    // The popped balloons leave a multiple of the bunch size (at least one pops).
    let popped = match all % k {
        0 => k,
        r => r,
    };
    let popped = d.stated(popped);
    let k = d.stated(k);
    let left = d.sub(all, popped);
    d.div(left, k);
    let pop = if popped == 1 { "pops" } else { "pop" };
    format!(
        "{name} buys {packs} packs of {per} balloons and {loose} single balloons for a party. {popped} of the \
         balloons {pop}. {They} ties the rest into bunches of {k}. How many bunches does {they} make?",
        name = p.name,
        They = capital(p.they),
        they = p.they
    )
}

fn wages(d: &mut Draw<'_>) -> String {
    let p = d.person();
    let job = d.pick(&["at a cafe", "at a bookshop", "in a garden centre", "at the library"]);
    let hours = d.given(2, 8);
    let days = d.given(2, 6);
    let rate = d.given(8, 25);
    let bonus = d.given(5, 50);
    let worked = d.mul(hours, days);
    let pay = d.mul(worked, rate);
    let total = d.add(pay, bonus);
    let spent = d.given(1, total / 2);
    d.sub(total, spent);
    format!(
        "{name} works {job} for {hours} hours a day on {days} days and earns ${rate} per hour. {They} also gets a \
         ${bonus} bonus. Then {they} spends ${spent} on groceries. How many dollars does {they} have left from \
         this work?",
        name = p.name,
        They = capital(p.they),
        they = p.they
    )
}

fn three_ages(d: &mut Draw<'_>) -> String {
    let a = d.person();
    let (b, c) = loop {
        let (b, c) = d.two_people();
        if b.name != a.name && c.name != a.name {
            break (b, c);
        }
    };
    let x = d.given(2, 20);
    let y = d.given(1, 25);
    let k = d.given(2, 3);
    let age_b = d.add(x, y);
    let age_c = d.mul(age_b, k);
    let ab = d.add(x, age_b);
    d.add(ab, age_c);
    format!(
        "{an} is {x} years old. {bn} is {y} years older than {an}, and {cn} is {k} times as old as {bn}. What is \
         the sum of their three ages?",
        an = a.name,
        bn = b.name,
        cn = c.name
    )
}

fn bookshop(d: &mut Draw<'_>) -> String {
    let shop = d.pick(&["A bookshop", "A toy shop", "A bakery", "A flower stall"]);
    let unit = match shop {
        "A bookshop" => "books",
        "A toy shop" => "toys",
        "A bakery" => "loaves",
        _ => "bunches of flowers",
    };
    let start = d.given(40, 200);
    let monday = d.given(1, start / 3);
    let tuesday = d.given(1, start / 3);
    let boxes = d.given(2, 6);
    let per = d.given(5, 20);
    let after_monday = d.sub(start, monday);
    let after_tuesday = d.sub(after_monday, tuesday);
    let delivered = d.mul(boxes, per);
    d.add(after_tuesday, delivered);
    format!(
        "{shop} has {start} {unit}. It sells {monday} on Monday and {tuesday} on Tuesday. On Wednesday a delivery \
         of {boxes} crates with {per} {unit} in each arrives. How many {unit} does it have now?"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_template_counts_its_steps_and_stays_whole() {
        for (i, template) in TEMPLATES.iter().enumerate() {
            for draw in 0..2000u64 {
                let mut rng = SplitMix64::new(mix(i as u64, draw));
                // Each template's own ranges, and capped at 1, 5, 10 and 20.
                let cap = [None, Some(1), Some(5), Some(10), Some(20)][(draw % 5) as usize];
                let mut d = Draw { rng: &mut rng, steps: Vec::new(), givens: Vec::new(), cap };
                let question = (template.write)(&mut d);
                assert_eq!(d.steps.len(), template.steps, "{}: {question}", template.name);
                for s in &d.steps {
                    match s.op {
                        Operator::Sub => assert!(s.right <= s.left, "{}: {s}", template.name),
                        Operator::Div => {
                            assert!(s.right > 0 && s.left.is_multiple_of(s.right), "{}: {s}", template.name)
                        }
                        Operator::Add | Operator::Mul => {}
                    }
                }
                assert!(!question.contains('{'), "{}: unfilled placeholder in {question}", template.name);
            }
        }
    }

    fn mix(a: u64, b: u64) -> u64 {
        metronome_core::mix64(a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b)
    }

    #[test]
    fn validation_names_the_key() {
        let bad = WordProblemConfig { steps: Span::new(0, 4), ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("word_problems.steps"));
        let bad = WordProblemConfig { steps: Span::new(1, 5), ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("word_problems.steps"));
        let bad = WordProblemConfig { format: "no placeholder".into(), ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("word_problems.format"));
        let bad = WordProblemConfig { size: 0, ..Default::default() };
        assert!(bad.validate().unwrap_err().to_string().contains("word_problems.size"));
    }
}
