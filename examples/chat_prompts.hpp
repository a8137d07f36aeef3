// Chat questions for the real model (SmolLM2-135M-Instruct): the test of greedy speculative decoding against
// target-only decoding uses all of them, the bucket sweep's timing phases the first kSweepChatQuestions, so
// both stand on the same real text.
#pragma once

namespace smcgraph::examples {

inline constexpr const char* kChatQuestions[] = {
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the ocean at night.",
    "Explain what a GPU is to a ten-year-old.",
    "List three tips for staying focused while studying.",
    "How do I make a cup of green tea?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the benefits of regular exercise?",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What is 17 times 23? Show your work.",
    "Describe a cat to someone who has never seen one.",
    "Write a haiku about autumn leaves.",
    "What is the difference between weather and climate?",
    "Suggest a name for a friendly robot.",
    "How many continents are there, and what are they?",
};
inline constexpr int kSweepChatQuestions = 8;
static_assert(kSweepChatQuestions <= static_cast<int>(sizeof(kChatQuestions) / sizeof(kChatQuestions[0])));

} // namespace smcgraph::examples
